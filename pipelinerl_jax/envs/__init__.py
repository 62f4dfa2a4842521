"""Environments: episodes of several model turns, each answered by the environment.

- protocol.py    Environment (first messages, respond to the turns so far) and Turn
- codec.py       messages -> token ids: the prompt, and each observation appended as sampled
- arithmetic.py  safe evaluation of an arithmetic expression (no `eval`): the calculator's core
- calculator.py  word problems with a calculator tool the model calls between its thoughts
- equations.py   the calculator completing the model's own equations at each "="
- python_tool.py math with a Python interpreter: fenced blocks run, their output shown
- sandbox.py     a model's Python in a child process with time, memory and output limits
- guess.py       guess a number with higher / lower feedback, within K turns
- retry.py       any task with feedback: a wrong answer may be tried again, within K turns
- single_turn.py any task with a reward function, as an environment of one turn
- registry.py    environments by name, or a user's own as "module.path:callable"
- runner.py      Environment.respond in worker processes, with a per-turn timeout

An environment is a pure function of the problem and the model's turns so far, so an episode
can be answered by any worker process and replayed after a resume. The pipeline side, a
sequence keeping its KV pages across turns and weight swaps, is pipeline/episodes.py.
"""

from pipelinerl_jax.envs.protocol import Environment, Turn

__all__ = ["Environment", "Turn"]
