"""Math with a Python interpreter, tool-integrated reasoning as ToRL and the reference's tool
domain train it: the model may write a fenced block

    ```python
    print(37 * 12)
    ```

and its turn ends at the closing fence; the environment runs the block (envs/sandbox.py: a
child process with time, memory and output limits) and writes what it printed inside the
model's own message as a fenced `output` block, and the model goes on from its kept KV cache.
A block whose last line is an expression shows its value, as a notebook cell does. A turn
that ends otherwise is the answer: its `\\boxed{}` is scored by math-verify.

With `keep_state` (the default) a block sees what the episode's earlier blocks defined: they
run again first, silently, in the same child, so a turn is still a pure function of the
episode's text (any worker answers it, a resumed run replays it).

The sandbox limits mistakes; it is not a security boundary (envs/sandbox.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs.calculator import Calculator
from pipelinerl_jax.envs.protocol import Turn, check_bool, check_int, check_number
from pipelinerl_jax.envs.sandbox import Limits, run_python
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.math import verify_math

# A block opens with ```python or ```py on its own line; the turn ends at a fence followed by
# a newline (the closing one: an opening fence is followed by the language's name).
_OPEN = re.compile(r"```(?:python|py)[ \t]*\n", re.IGNORECASE)
CLOSE = "```"
SYSTEM = (
    "Solve the problem step by step. To compute, write Python code in a ```python block; it is "
    "run and what it prints is shown to you in an ```output block. Put the final answer in "
    "\\boxed{}."
)
EXAMPLE = (
    {"role": "user", "content": "A box holds 12 pens. How many pens are in 37 boxes?"},
    {
        "role": "assistant",
        "content": (
            "Each box holds 12 pens, so 37 boxes hold:\n```python\nprint(37 * 12)\n```\n"
            "```output\n444\n```\nThe answer is \\boxed{444}."
        ),
    },
)
NO_OUTPUT = "(no output)"  # said when a block printed nothing: an empty block reads as lost


def last_block(turn: str) -> str | None:
    """The code of a block that ends the turn (its closing fence last, only whitespace after
    it), else None: the turn went on after its block, or never closed one."""
    opens = list(_OPEN.finditer(turn))
    if not opens:
        return None
    body = turn[opens[-1].end() :]
    if CLOSE not in body:
        return None
    code, after = body.split(CLOSE, 1)
    return code if not after.strip() else None


class PythonTool(Calculator):
    """The calculator's prompt layout and scoring; its tool: a Python interpreter."""

    name = "python"
    max_turns = 4
    stop_strings = (CLOSE + "\n",)
    system = SYSTEM
    shown = EXAMPLE
    ERROR = "Error: "

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        example: bool = True,
        timeout_s: float = 3.0,
        memory_mb: int = 1024,
        max_output_chars: int = 512,
        keep_state: bool = True,
    ):
        super().__init__(max_turns=max_turns, example=example)
        timeout_s = check_number(self.name, "timeout_s", timeout_s, lo=0, hi=600)
        if timeout_s == 0:
            raise ConfigError("environment python: option timeout_s=0 must be > 0 seconds")
        self.limits = Limits(
            timeout_s=timeout_s,
            # Python itself and the standard library take ~30 MB of address space.
            memory_mb=check_int(self.name, "memory_mb", memory_mb, lo=64),
            max_output_chars=check_int(self.name, "max_output_chars", max_output_chars, lo=1),
        )
        self.keep_state = check_bool(self.name, "keep_state", keep_state)

    @property
    def turn_seconds(self) -> float:
        """The most seconds one turn takes by its own limit (EnvSpec checks its timeout)."""
        return self.limits.timeout_s

    def texts(self) -> dict[str, str]:
        shown = "".join(m["content"] for m in self.shown) if self.example else ""
        results = f"\n```output\n{NO_OUTPUT}\n{self.ERROR}\n```\n"
        return {"system prompt": self.system + shown, "results": results}

    def respond(self, problem: Problem, turns: Sequence[str]) -> Turn:
        code = last_block(turns[-1])
        if code is None:
            verdict = verify_math(turns[-1], problem.answer)
            return Turn(None, reward=verdict.score, done=True, info={"status": verdict.status})
        earlier = ()
        if self.keep_state:
            earlier = tuple(c for c in map(last_block, turns[:-1]) if c is not None)
        result = run_python(code, self.limits, earlier)
        shown = result.output.rstrip("\n")
        if result.error:
            shown = f"{shown}\n{self.ERROR}{result.error}" if shown else self.ERROR + result.error
        # The turn ended at "```\n" (the stop string) or at "```" and EOS: a newline first then.
        lead = "" if turns[-1].endswith("\n") else "\n"
        text = f"{lead}```output\n{shown or NO_OUTPUT}\n```\n"
        info = {"tool_calls": 1}
        if result.error:
            info["tool_errors"] = 1
        if result.timed_out:
            info["tool_timeouts"] = 1
        return Turn({"role": "text", "content": text}, info=info)
