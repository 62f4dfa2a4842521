"""Where a turn ends on a stop string (text an environment names, e.g. "</calc>").

Stop strings are text, tokens are not: a string can end inside a token, or span several. After
each decode chunk the scheduler asks `stop_string_cut` whether the current turn's text now holds
one, and where the fewest tokens that hold it end; the tokens after that point are dropped.
"""

from __future__ import annotations


def stop_string_cut(detokenize, turn: list[int], checked: int, stops) -> int | None:
    """How many tokens of `turn` to keep: the fewest whose text holds one of `stops`, or None
    if the whole turn's text holds none. The first `checked` tokens are known to hold none (an
    earlier chunk's check). One decode when nothing is found; a bisection over the new
    tokens, a few decodes more, when something is (exact while a longer prefix's text extends
    a shorter one's, as with BPE decoders)."""

    def holds(k: int) -> bool:
        text = detokenize(turn[:k])
        return any(s in text for s in stops)

    if not holds(len(turn)):
        return None
    lo, hi = checked, len(turn)  # holds(lo) is False, holds(hi) is True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi
