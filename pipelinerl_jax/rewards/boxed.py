"""The answer a math text gives: the content of its last `\\boxed{...}`.

One function reads both a dataset's gold solution (data/formats.py) and a completion
(rewards/math.py), so the two are read the same way. No math-verify here: data imports it.
"""

import re

_BOXED_HEADS = ("\\boxed", "\\fbox")


def _braced(text: str, open_at: int) -> str | None:
    """Content of the brace group opening at text[open_at] == "{", or None if unbalanced."""
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # skip the escaped character: \{ and \} (LaTeX set braces) do not nest
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in text, else None.

    Braces nest: `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. An unclosed last box gives None
    (the completion was cut off before the answer ended).
    """
    start = max(text.rfind(head) for head in _BOXED_HEADS)
    if start < 0:
        return None
    head = next(h for h in _BOXED_HEADS if text.startswith(h, start))
    rest = start + len(head)
    j = rest
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        return _braced(text, j)
    if head == "\\boxed" and j > rest:  # "\boxed 5": the answer runs to "$" or whitespace
        match = re.match(r"[^\s$]+", text[j:])
        return match.group(0) if match else None
    return None
