"""Rewards: verifying answers and paying for them.

- math.py                  math-verify on the last \\boxed{} of a completion against the gold
- reasoning_gym_scorer.py  reasoning-gym's datasets, and their scorers as a reward function
- tables.py                verdicts and reward tables: what a reward function says, what the
                           trainer is paid
- workers.py               a process pool for reward functions with a hard per-sample timeout
"""
