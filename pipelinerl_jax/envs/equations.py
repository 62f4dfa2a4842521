"""A calculator that completes the model's own equations: the turn ends at "=", and when the
text before it on its line ends with an arithmetic expression ("so 37 boxes hold 37 * 12 ="),
the environment writes its value (" 444") inside the model's message and the model goes on.
The final `\\boxed{}` answer is scored by math-verify.

The tool for a model too small to learn a call syntax: a 135M chat model writes its
arithmetic as equations anyway and almost never writes `<calc>` tags, however it is shown
them (calculator.py). Here every equation it writes is a tool call, and what RL can teach it
is to lean on them: to write the arithmetic out rather than state a result.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs import arithmetic
from pipelinerl_jax.envs.calculator import Calculator
from pipelinerl_jax.envs.protocol import Turn
from pipelinerl_jax.rewards.math import verify_math

SYSTEM = (
    "Solve the problem step by step. A calculator writes the value after every '=' you write "
    "after a calculation. Put the final answer in \\boxed{}."
)
EXAMPLE = (
    {"role": "user", "content": "A box holds 12 pens. How many pens are in 37 boxes?"},
    {
        "role": "assistant",
        "content": "Each box holds 12 pens, so 37 boxes hold 37 * 12 = 444 pens.\n"
        "The answer is \\boxed{444}.",
    },
)
# A blank when there is nothing to compute: an observation has at least one token, and the
# space is what the model would most likely have written after "=".
NOTHING = " "


def trailing_expression(text: str) -> str | None:
    """The longest arithmetic expression ending `text`'s last line (the text before the
    "=" that ended the turn), with at least one operator; None when there is none."""
    line = text.rsplit("\n", 1)[-1]
    for start in range(len(line)):
        candidate = line[start:].strip()
        if not candidate or not any(op in candidate for op in "+-*/^()"):
            continue
        if candidate[0] in "+*/^)" or not any(ch.isdigit() for ch in candidate):
            continue
        try:
            arithmetic.evaluate(candidate)
        except arithmetic.ExpressionError:
            continue
        return candidate
    return None


class Equations(Calculator):
    """The calculator's prompt layout and scoring; its own call syntax: "=" ends the turn."""

    name = "equations"
    max_turns = 8
    stop_strings = ("=",)
    system = SYSTEM
    shown = EXAMPLE

    def texts(self) -> dict[str, str]:
        return {**super().texts(), "results": f"{NOTHING}-0.5"}

    def respond(self, problem: Problem, turns: Sequence[str]) -> Turn:
        turn = turns[-1]
        if not turn.rstrip().endswith("="):  # ended at EOS or the budget: the answer
            verdict = verify_math(turn, problem.answer)
            return Turn(None, reward=verdict.score, done=True, info={"status": verdict.status})
        expression = trailing_expression(turn.rstrip()[:-1])
        if expression is None:  # nothing computable (a word, 10 / 0): the model goes on
            return Turn({"role": "text", "content": NOTHING}, info={"no_calls": 1})
        value = arithmetic.show(arithmetic.evaluate(expression))
        return Turn({"role": "text", "content": f" {value}"}, info={"tool_calls": 1})
