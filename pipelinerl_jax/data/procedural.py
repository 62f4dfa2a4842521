"""A procedural task's problems as a random-access source (what grain's MapDataset needs)."""

import hashlib

from pipelinerl_jax.data.formats import Problem


class ProceduralSource:
    """Random-access view of a task's problems (what grain's MapDataset.source needs)."""

    def __init__(self, task):
        self.task = task

    def __len__(self) -> int:
        return self.task.num_problems

    def __getitem__(self, i: int) -> Problem:
        return self.task.problem(i)

    def fingerprint(self) -> str:
        return hashlib.sha1(repr(self.task).encode()).hexdigest()[:16]
