"""The Sampler protocol (sampler/protocol.py) is all the pipeline uses of a sampler.

A fake sampler that has only the protocol's members (random digits, a random stop, every token
tagged with the version it holds, params kept as host copies, as a sampler in another process
would) drives a real run with the real trainer: every attempt it returns is trained exactly as
it returned it, in start order, within the lag bound, and the params it is handed for version v
are the trainer's params after step v. PagedSampler satisfies the protocol, and its `prepare`
output survives the trainer donating the params it came from.
"""

import json
import threading

import jax
import numpy as np
import pytest

from pipelinerl_jax import pipeline, presets
from pipelinerl_jax.data.datasets import PromptStream
from pipelinerl_jax.pipeline import components
from pipelinerl_jax.sampler.protocol import Sample, Sampler
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams

EOS = 2  # the task tokenizer's <eos>; digits are ids 3..12


class FakeSampler:
    """The protocol's members and nothing else: the run fails if it reaches for more."""

    def __init__(self, num_slots: int, seed: int, tokens_per_step: int = 3):
        self.num_slots = num_slots
        self.version = 0
        self.tokens_per_step = tokens_per_step
        self._rng = np.random.default_rng(seed)
        self._waiting: list[dict] = []
        self._running: list[dict] = []
        self._staged = None
        self._lock = threading.Lock()
        # What a test inspects; the protocol does not need them.
        self.returned: dict[tuple[int, int], Sample] = {}
        self.handed: dict[int, object] = {}  # version -> the params set_params received

    def submit(self, prompt_ids, *, n=1, params=SamplingParams(), request_id=None):
        for attempt in range(n):
            self._waiting.append(
                dict(
                    request_id=request_id,
                    attempt=attempt,
                    prompt_ids=list(prompt_ids),
                    limit=params.max_new_tokens,
                    token_ids=[],
                    logprobs=[],
                    versions=[],
                    start_version=None,
                )
            )
        return request_id

    def has_work(self):
        return bool(self._waiting or self._running)

    def step(self):
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            _, self.version = staged
        while self._waiting and len(self._running) < self.num_slots:
            attempt = self._waiting.pop(0)
            attempt["start_version"] = self.version
            self._running.append(attempt)
        finished = []
        for a in list(self._running):
            for _ in range(self.tokens_per_step):
                stop = self._rng.random() < 0.3
                a["token_ids"].append(EOS if stop else int(self._rng.integers(3, 13)))
                a["logprobs"].append(float(-3.0 * self._rng.random()))
                a["versions"].append(self.version)
                if stop or len(a["token_ids"]) >= a["limit"]:
                    self._running.remove(a)
                    sample = Sample(
                        **{k: v for k, v in a.items() if k != "limit"},
                        finish_reason="stop" if stop else "length",
                    )
                    self.returned[(sample.request_id, sample.attempt)] = sample
                    finished.append(sample)
                    break
        return finished

    def prepare(self, params):
        return jax.tree.map(np.array, params)  # host copies: nothing the trainer can donate

    def set_params(self, params, version, *, prepared=False):
        params = params if prepared else self.prepare(params)
        with self._lock:
            self._staged = (params, version)
            self.handed[version] = params


class RecordingTrainer:
    """The real trainer, keeping each step's batch and the params it produced."""

    def __init__(self, trainer):
        self.trainer, self.batches, self.params_after = trainer, [], []

    def train_step(self, state, batch):
        self.batches.append(batch)
        state, metrics = self.trainer.train_step(state, batch)
        self.params_after.append(jax.tree.map(np.array, state.params))
        return state, metrics


def _completions(batch):
    """{group id: sorted [(completion tokens, versions, behaviour logprobs)]} of a batch."""
    out = {}
    for r in range(batch.tokens.shape[0]):
        for seg in np.unique(batch.segment_ids[r]):
            if seg == 0:
                continue
            idx = np.nonzero(batch.segment_ids[r] == seg)[0]
            mask = batch.loss_mask[r, idx] > 0
            first = int(np.argmax(mask))  # scores the first completion token
            group = int(batch.group_ids[batch.sequence_index[r, idx][mask][0]])
            out.setdefault(group, []).append(
                (
                    tuple(batch.tokens[r, idx][first + 1 :].tolist()),
                    tuple(batch.versions[r, idx][mask].tolist()),
                    tuple(np.round(batch.behaviour_logprobs[r, idx][mask], 5).tolist()),
                )
            )
    return {g: sorted(v) for g, v in out.items()}


def test_a_fake_sampler_drives_a_real_run(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 16))
    cfg = presets.tiny(steps=4, max_lag=1, seed=seed, log_every=0, eval_every=0, checkpoint_every=0)
    c = pipeline.build(cfg)
    fake = FakeSampler(num_slots=cfg.sampler.num_slots // 2, seed=seed)
    c.sampler, c.trainer = fake, RecordingTrainer(c.trainer)
    summary = pipeline.run(cfg, str(tmp_path), components=c, echo=lambda *_: None)
    assert summary["steps"] == 4 and summary["lag/token_max"] <= 1

    g, size = cfg.groups_per_step, cfg.group_size
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r["prompts"] for r in records if r["kind"] == "train"]
    # Start order: the config's stream, drawn in order, g groups a step.
    stream = PromptStream(components.build_data(cfg)[1], seed=cfg.data.shuffle_seed + cfg.seed)
    expected = [next(stream) for _ in range(4 * g)]
    assert trained == [[p.uid for p in expected[s * g : (s + 1) * g]] for s in range(4)]
    for s, batch in enumerate(c.trainer.batches):
        got = _completions(batch)
        assert sorted(got) == list(range(s * g, (s + 1) * g))
        for index in got:
            samples = [fake.returned[(index, a)] for a in range(size)]
            assert all(x.prompt_ids == c.encode_prompt(expected[index]) for x in samples)
            want = sorted(
                (
                    tuple(x.token_ids),
                    tuple(x.versions),
                    tuple(np.round(np.float32(x.logprobs), 5).tolist()),
                )
                for x in samples
            )
            assert got[index] == want
            lags = s - np.concatenate([x.versions for x in samples])
            assert lags.min() >= 0 and lags.max() <= cfg.max_lag
    # Weights went through the protocol: version v is the trainer's params after step v.
    assert fake.handed and sorted(fake.handed) == list(fake.handed)
    for version, params in fake.handed.items():
        assert 1 <= version <= 4
        jax.tree.map(np.testing.assert_array_equal, params, c.trainer.params_after[version - 1])


def test_paged_sampler_is_a_sampler_and_prepare_survives_donation():
    cfg = presets.tiny(seed=int(np.random.default_rng().integers(1 << 16)))
    tokenizer = components.build_data(cfg)[0]
    graphdef, params = components.build_model(cfg, tokenizer, jax.random.key(cfg.seed))
    sampler = PagedSampler(graphdef, params, cfg.sampler)
    assert isinstance(sampler, Sampler) and sampler.num_slots == cfg.sampler.num_slots
    expected = jax.tree.map(np.array, sampler.prepare(params))
    prepared = sampler.prepare(params)
    # The trainer's next step donates its params; the prepared copy must not be them.
    jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(params)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, prepared), expected)
    sampler.set_params(prepared, 1, prepared=True)
    sampler.submit([1, 4, 5, 6, 15], n=2, params=SamplingParams(max_new_tokens=3))
    samples = [s for _ in range(8) for s in sampler.step()]
    assert len(samples) == 2 and all(set(s.versions) == {1} for s in samples)


MEMBERS = ("version", "num_slots", "submit", "has_work", "step", "prepare", "set_params")


@pytest.mark.parametrize("missing", MEMBERS)
def test_the_protocol_is_the_seven_members(missing):
    fake = FakeSampler(num_slots=2, seed=1)
    assert isinstance(fake, Sampler)
    members = {name: getattr(fake, name) for name in MEMBERS if name != missing}
    assert not isinstance(type("Partial", (), members)(), Sampler)
    assert isinstance(type("Whole", (), {**members, missing: getattr(fake, missing)})(), Sampler)
