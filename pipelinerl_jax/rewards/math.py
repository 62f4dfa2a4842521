"""Math answer verification with math-verify: last \\boxed{} of the completion vs the gold.

Statuses: `no_answer` (no \\boxed{}), `unparsable` (a box whose content math-verify cannot
read and that does not equal the gold as text), `correct` / `wrong` (math-verify's comparison:
numeric, symbolic, sets, intervals, ... in strict mode), `error` (an exception, or a gold that
does not parse). `timeout` is assigned by the worker pool (workers.py), never here.

math-verify's own timeouts use SIGALRM, which raises off the main thread and has one-second
resolution; they are disabled here and the hard per-sample timeout of `RewardPool` (a worker
process killed and replaced) bounds the time instead. Calling `verify_math` in-process is
fine for trusted inputs (tests, evaluation of known answers) but has no time bound.
"""

import functools
import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from pipelinerl_jax.rewards.boxed import last_boxed
from pipelinerl_jax.rewards.tables import Verdict


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off: intended here (the pool bounds time)."""

    def filter(self, record):
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())

_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())


def _parse_boxed(content: str) -> list:
    """math-verify's reading of an answer, as if it were written \\boxed{content}."""
    return parse(
        f"\\boxed{{{content}}}",
        extraction_config=_EXTRACTION,
        fallback_mode="first_match",
        parsing_timeout=None,
    )


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    # A group's attempts share one gold: parse it once per process.
    boxed = last_boxed(gold)
    return tuple(_parse_boxed(boxed if boxed is not None else gold.strip().strip("$")))


def _is_parsed(items) -> bool:
    """True when math-verify produced a math object, not only its raw-string fallback."""
    return any(not isinstance(x, str) for x in items)


def verify_math(completion: str, gold: str, *, strict: bool = True) -> Verdict:
    """Verdict of the completion's last \\boxed{} answer against the gold answer."""
    try:
        predicted = last_boxed(completion)
        if predicted is None:
            return Verdict(status="no_answer")
        predicted = predicted.strip()
        if not predicted:
            return Verdict(status="unparsable", predicted="", detail="empty \\boxed{}")
        gold_items = list(_parse_gold(gold))
        if not gold_items:
            return Verdict(
                status="error",
                predicted=predicted,
                detail=f"gold answer {gold[:80]!r} does not parse",
            )
        pred_items = _parse_boxed(predicted)
        if not pred_items:
            return Verdict(status="unparsable", predicted=predicted)
        if verify(gold_items, pred_items, strict=strict, timeout_seconds=None):
            return Verdict(status="correct", score=1.0, predicted=predicted)
        if not _is_parsed(pred_items):
            return Verdict(
                status="unparsable",
                predicted=predicted,
                detail="not a math expression and not equal to the gold as text",
            )
        return Verdict(status="wrong", predicted=predicted)
    except Exception as e:  # a reward must never take the run down: report and move on
        return Verdict(status="error", detail=f"{type(e).__name__}: {e}"[:200])


def math_reward(completion: str, problem) -> Verdict:
    """The `math` built-in reward function: `problem.answer` is the gold."""
    return verify_math(completion, problem.answer)
