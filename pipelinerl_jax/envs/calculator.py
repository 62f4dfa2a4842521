"""Word problems with a calculator: the model may write `<calc>expression</calc>`, the turn
ends there, and the environment answers with the value (or why it could not compute it) as
text inside the model's own message (`<calc>6*7</calc> = 42`), so a chat model that was never
taught a tool role just reads on; the model goes on and ends with its answer in \\boxed{},
scored by math-verify against the gold. Expressions are evaluated by arithmetic.py, never by
`eval`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs import arithmetic
from pipelinerl_jax.envs.protocol import Environment, Turn, check_bool
from pipelinerl_jax.rewards.math import verify_math

OPEN, CLOSE = "<calc>", "</calc>"
SYSTEM = (
    "Solve the problem step by step. To compute, write the arithmetic as "
    f"{OPEN}expression{CLOSE} and wait for its value. Put the final answer in \\boxed{{}}."
)


def last_call(turn: str) -> str | None:
    """The expression of a call that ends the turn (the stop string may or may not be kept
    in the sampled text), else None."""
    at = turn.rfind(OPEN)
    if at < 0:
        return None
    body = turn[at + len(OPEN) :]
    if CLOSE in body:
        body, after = body.split(CLOSE, 1)
        if after.strip():
            return None  # the model went on after a call it closed itself: no pending call
    return body.strip()


# A worked example, shown as an earlier exchange: a small chat model follows a shown format
# far more often than a described one.
EXAMPLE = (
    {"role": "user", "content": "A box holds 12 pens. How many pens are in 37 boxes?"},
    {
        "role": "assistant",
        "content": (
            f"Each box holds 12 pens, so 37 boxes hold {OPEN}37 * 12{CLOSE} = 444 pens.\n"
            "The answer is \\boxed{444}."
        ),
    },
)


class Calculator(Environment):
    name = "calculator"
    max_turns = 4
    stop_strings = (CLOSE,)
    system: str = SYSTEM  # the system prompt: how to call the tool
    shown: tuple = EXAMPLE  # the worked example's exchange, shown before the problem
    ERROR = " error: "  # what a result that could not be computed starts with

    def __init__(self, *, max_turns: int | None = None, example: bool = True):
        super().__init__(max_turns=max_turns)
        self.example = check_bool(self.name, "example", example)

    def texts(self) -> dict[str, str]:
        shown = "".join(m["content"] for m in self.shown) if self.example else ""
        # A result's characters: a value (" = -12.5") or why there is none (" error: ...").
        return {"system prompt": self.system + shown, "results": f" = -0.5{self.ERROR}"}

    def first_messages(self, problem: Problem) -> list[dict]:
        shown = [dict(m) for m in self.shown] if self.example else []
        return [
            {"role": "system", "content": self.system},
            *shown,
            {"role": "user", "content": problem.question},
        ]

    def respond(self, problem: Problem, turns: Sequence[str]) -> Turn:
        expression = last_call(turns[-1])
        if expression is None:
            verdict = verify_math(turns[-1], problem.answer)
            return Turn(None, reward=verdict.score, done=True, info={"status": verdict.status})
        try:
            value = f" = {arithmetic.show(arithmetic.evaluate(expression))}"
            info = {"tool_calls": 1}
        except arithmetic.ExpressionError as e:
            value = f"{self.ERROR}{e}"
            info = {"tool_calls": 1, "tool_errors": 1}
        return Turn({"role": "text", "content": value}, info=info)
