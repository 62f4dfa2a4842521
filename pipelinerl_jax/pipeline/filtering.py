"""Dynamic sampling (batch.filter_groups): groups that teach nothing are dropped and refilled.

A group whose attempts all score alike has zero advantage under every group baseline, so it
spends a step's compute on no gradient. DAPO drops such groups and samples more until the step
is full. Here the decision is made as soon as a group is scored, on its *raw* scores (the
verifier's `Verdict.score`, 0 for an unscored attempt), never on the shaped reward: a format
bonus or an overlong penalty can differ between attempts that all failed, and filtering on
the shaped reward keeps exactly the groups that teach nothing about the task (NeMo-RL #2431).
`batch.filter_min_std` > 0 also drops groups that differ only a little.

Lag bound and start order (admission.py proves both): a dropped group gives its admission slot
back (`Admission.drop`), and each step trains the next `groups_per_step` kept groups in start
order (`ReadyBoard.take_kept`), waiting for earlier groups that are still generating, so the
batch is never biased towards what finishes first.

A run whose groups nearly all score alike (too easy or too hard a task) would spin: the
refills are capped at `batch.filter_refill_limit` steps' worth of groups per trained step, on
average over the run; past it a group that would be dropped is trained (counted as forced).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def raw_scores(group) -> np.ndarray:
    """The verifier's scores of a group's attempts (0 where it gave none)."""
    return np.array(
        [v.score if v.status in ("correct", "wrong") else 0.0 for v in group.verdicts], float
    )


@dataclasses.dataclass
class GroupFilter:
    """Decides, per scored group, whether it is dropped; counts what it decided."""

    min_std: float  # drop groups whose raw scores' std is at most this (0: all equal)
    refill_limit: float  # refills per trained step, in steps' worth of groups, on average
    groups_per_step: int
    dropped: int = 0  # groups dropped so far (each refilled by a newly admitted one)
    forced: int = 0  # groups trained only because the refill cap was reached
    seen: int = 0  # groups scored so far

    @classmethod
    def from_config(cls, batch_cfg, groups_per_step: int) -> GroupFilter | None:
        if not batch_cfg.filter_groups:
            return None
        return cls(batch_cfg.filter_min_std, batch_cfg.filter_refill_limit, groups_per_step)

    def drops(self, group, steps_begun: int) -> bool:
        """Whether the scored `group` is dropped, `steps_begun` steps into the run."""
        self.seen += 1
        if len(group.verdicts) > 1 and float(np.std(raw_scores(group))) > self.min_std:
            return False
        budget = self.refill_limit * self.groups_per_step * (steps_begun + 1)
        if self.dropped >= budget:
            self.forced += 1
            return False
        self.dropped += 1
        return True

    def record(self, dropped_groups) -> dict:
        """This step's filter metrics: the dropped groups it walked past, their raw and shaped
        rewards apart, and the run's totals."""
        out = {
            "filter/dropped": len(dropped_groups),
            "filter/dropped_total": self.dropped,
            "filter/forced_total": self.forced,
            "filter/kept_frac": 1.0 - self.dropped / max(self.seen, 1),
        }
        scored = [g for g in dropped_groups if g.verdicts]  # a resume keeps only the index
        if scored:
            out["filter/dropped_raw_mean"] = float(np.mean([raw_scores(g) for g in scored]))
            out["filter/dropped_shaped_mean"] = float(np.mean([g.rewards for g in scored]))
        return out

    def state(self) -> dict:
        return {"dropped": self.dropped, "forced": self.forced, "seen": self.seen}

    def restore(self, state: dict) -> None:
        self.dropped, self.forced, self.seen = (
            int(state[k]) for k in ("dropped", "forced", "seen")
        )
