"""Groups in flight: the attempts of one prompt, from submission to a scored training group.

The sampler thread opens a group when admission lets it start, adds each finished attempt,
and hands the full group to the reward pool. When every verdict is back the group becomes
`ready` and the trainer thread may take it. A `ReadyBoard` is the hand-off point: a dict of
ready groups keyed by start index plus a condition variable, so the trainer can wait for
exactly the groups its next step must train (start order, see admission.py).

What the reward pool scores of an attempt is `completion_text`: its tokens decoded with every
special token visible, less the final stop token.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Collection, Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.tasks import CharTokenizer
from pipelinerl_jax.models.tokenizer import Tokenizer
from pipelinerl_jax.rewards.tables import Verdict
from pipelinerl_jax.rl.batch import ScoredSample
from pipelinerl_jax.sampler.protocol import Sample


@dataclasses.dataclass
class Group:
    """One prompt's attempts. `index` is the start index given by admission."""

    index: int
    problem: object  # data.formats.Problem
    prompt_ids: list[int]
    samples: list = dataclasses.field(default_factory=list)  # protocol.Sample, by arrival
    verdicts: list = dataclasses.field(default_factory=list)  # rewards.tables.Verdict
    rewards: list[float] = dataclasses.field(default_factory=list)
    episodes: list = dataclasses.field(default_factory=list)  # episodes.Episode, by attempt
    #   (multi-turn runs; a checkpoint keeps their samples, rewards and `finished` only)
    restored_finished: list[bool] | None = None  # finished(), as a checkpoint saved it
    dropped: bool = False  # dynamic sampling dropped it (filtering.py): never trained
    started_at: float = dataclasses.field(default_factory=time.perf_counter)

    def to_json(self, with_samples: bool) -> dict:
        """For checkpoints: the prompt always; samples and rewards only when fully scored."""
        out = {"index": self.index, "problem": dataclasses.asdict(self.problem)}
        if with_samples:
            out["samples"] = [dataclasses.asdict(s) for s in self.samples]
            out["rewards"] = list(self.rewards)
            out["statuses"] = [v.status for v in self.verdicts]
            out["finished"] = self.finished()
        return out

    @classmethod
    def from_json(cls, d: dict, encode_prompt) -> Group:

        problem = Problem(**d["problem"])
        group = cls(index=int(d["index"]), problem=problem, prompt_ids=encode_prompt(problem))
        if "samples" in d:
            group.samples = [Sample(**s) for s in d["samples"]]
            group.rewards = [float(r) for r in d["rewards"]]
            group.verdicts = [Verdict(status=st) for st in d["statuses"]]
            group.restored_finished = d.get("finished")
        return group

    def finished(self) -> list[bool]:
        """Per attempt: it ended as it should (EOS; an episode: its environment ended it),
        not at the token budget."""
        if self.episodes:
            return [e.ending == "ok" for e in self.episodes]
        if self.restored_finished is not None:
            return list(self.restored_finished)
        return [s.finish_reason == "stop" for s in self.samples]

    def train_samples(self) -> list[ScoredSample]:
        """The group as the trainer's batch builder wants it."""
        return [
            ScoredSample(
                prompt_tokens=s.prompt_ids,
                completion_tokens=s.token_ids,
                completion_logprobs=s.logprobs,
                completion_versions=s.versions,
                reward=r,
                group_id=self.index,
                finished=f,
            )
            for s, r, f in zip(self.samples, self.rewards, self.finished())
        ]


class ReadyBoard:
    """Scored groups waiting for the trainer, keyed by start index."""

    def __init__(self):
        self._ready: dict[int, Group] = {}
        self._cond = threading.Condition()

    def put(self, group: Group) -> None:
        with self._cond:
            self._ready[group.index] = group
            self._cond.notify_all()

    def _kept_end(self, start: int, count: int) -> int | None:
        """The index after the `count`-th kept group from `start`, if every group up to it
        is here (dropped ones are walked past), else None. Under the lock."""
        i, kept = start, 0
        while kept < count:
            group = self._ready.get(i)
            if group is None:
                return None
            kept += not group.dropped
            i += 1
        return i

    def wait_kept(self, start: int, count: int, stop: threading.Event, poll_s=0.05) -> bool:
        """Blocks until `count` kept groups from `start` on are here (True) or `stop` is set."""
        with self._cond:
            while self._kept_end(start, count) is None:
                if stop.is_set():
                    return False
                self._cond.wait(poll_s)
            return True

    def take_kept(self, start: int, count: int, stop: threading.Event, poll_s=0.05):
        """The next `count` kept groups in start order from `start`: (kept, dropped walked
        past, the next start), all removed; None once `stop` is set."""
        if not self.wait_kept(start, count, stop, poll_s):
            return None
        with self._cond:
            end = self._kept_end(start, count)
            taken = [self._ready.pop(i) for i in range(start, end)]
        return [g for g in taken if not g.dropped], [g for g in taken if g.dropped], end

    def dropped_indices(self) -> list[int]:
        """Dropped groups not yet walked past (what a checkpoint must keep)."""
        with self._cond:
            return sorted(i for i, g in self._ready.items() if g.dropped)

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    def pending(self) -> list[Group]:
        """Ready, untrained groups in start order (dropped ones included)."""
        with self._cond:
            return [self._ready[i] for i in sorted(self._ready)]


def completion_text(
    tokenizer: Tokenizer | CharTokenizer, token_ids: Sequence[int], stop_ids: Collection[int]
) -> str:
    """What the reward function scores: the completion minus its final stop token, with every
    other token visible. Skipping special tokens here would hide junk from the reward: the
    default run's tiny model learned to pad answers with <pad>/<bos> instead of stopping,
    and scored them as exact."""
    ids = list(token_ids)
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)
