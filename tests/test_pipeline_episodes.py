"""Multi-turn episodes through the whole pipeline: the guess-a-number environment on the
tiny model, with weights swapped between any two chunks (so between turns, and inside them).

As in test_pipeline_run.py, a scripted trainer alternates the policy between two known
parameter sets (A at even versions, B at odd ones), so every trained episode can be replayed
token by token with the params of each token's version. An episode keeps its KV pages across
turns: the observation tokens are prefilled when the episode resumes, by the params that
decode the turn after them, and each position's K/V comes from the step that consumes it.
The replay must reproduce every behaviour logprob the sampler recorded; a token tagged with
the wrong version, or a cache that lost or recomputed a turn, would not.
"""

import json

import numpy as np
import pytest

from pipelinerl_jax import presets
from pipelinerl_jax.pipeline import runner as run_lib
from tests.test_pipeline_run import replay_logprobs, run_scripted

SMALL = dict(
    group_size=4,
    batch_size=16,
    log_every=0,
    eval_every=0,
    sampler=dict(num_slots=16, chunk_steps=2),
    **{
        "model.init.hidden_size": 32,
        "model.init.intermediate_size": 64,
        "model.init.num_heads": 2,
        "model.init.num_kv_heads": 1,
        "model.init.head_dim": 16,
    },
)


def episodes_of(batch):
    """(tokens, completion versions, behaviour logprobs, prompt length) per packed episode,
    over every completion position (observations included, version -1)."""
    out = []
    for r in range(batch.tokens.shape[0]):
        for seg in np.unique(batch.segment_ids[r]):
            if seg == 0:
                continue
            idx = np.nonzero(batch.segment_ids[r] == seg)[0]
            first = int(np.argmax(batch.loss_mask[r, idx] > 0))  # scores completion token 0
            tokens = batch.tokens[r, idx]
            scored = slice(first, len(idx) - 1)
            out.append(
                (
                    tokens,
                    batch.loss_mask[r, idx][scored] > 0,
                    batch.versions[r, idx][scored],
                    batch.behaviour_logprobs[r, idx][scored],
                    first + 1,
                )
            )
    return out


def kv_versions(model, versions):
    """The version whose params computed each completion position's input: an observation
    token is prefilled by the params that decode the turn after it."""
    out = np.array(versions)
    nxt = None
    for i in range(len(out) - 1, -1, -1):
        if model[i]:
            nxt = out[i]
        else:
            out[i] = nxt
    return out


@pytest.fixture(scope="module")
def guess_run():
    cfg = presets.guess(steps=8, max_lag=2, **SMALL)
    return cfg, *run_scripted(cfg)


def test_episodes_span_turns_and_swaps(guess_run):
    cfg, summary, trainer, _ = guess_run
    eps = [e for b in trainer.batches for e in episodes_of(b)]
    assert len(eps) == 8 * 16
    turns = [1 + np.count_nonzero(np.diff((~m).astype(int)) == 1) for _, m, *_ in eps]
    assert max(turns) >= 3, "no episode went past two turns"
    across = [e for e in eps if len(set(e[2][e[1]])) > 1]
    assert across, "no swap landed inside an episode"
    for tokens, model, versions, behaviour, prompt_len in across + eps[:6]:
        assert np.all(np.diff(versions[model]) >= 0)
        assert len(tokens) - prompt_len <= cfg.max_new_tokens
        replayed = replay_logprobs(
            _graphdef(guess_run),
            trainer.params_of,
            tokens,
            kv_versions(model, versions),
            prompt_len,
        )
        np.testing.assert_allclose(behaviour[model], replayed[model], atol=2e-4, rtol=2e-4)
        assert np.all(behaviour[~model] == 0.0)
    # The replay can fail: shifting every version changes the logprobs.
    tokens, model, versions, behaviour, prompt_len = across[0]
    wrong = replay_logprobs(
        _graphdef(guess_run),
        trainer.params_of,
        tokens,
        kv_versions(model, versions) + 1,
        prompt_len,
    )
    assert np.abs(wrong[model] - behaviour[model]).max() > 1e-2


def _graphdef(run):
    return run[3]


def test_the_lag_bound_holds_over_whole_episodes(guess_run):
    cfg, summary, trainer, _ = guess_run
    for step, batch in enumerate(trainer.batches):
        lags = step - batch.versions[batch.loss_mask > 0]
        assert lags.min() >= 0 and lags.max() <= cfg.max_lag
    assert summary["lag/token_max"] <= cfg.max_lag


def test_conventional_episodes_use_the_round_version():
    cfg = presets.guess(steps=4, mode="conventional", conventional_steps=2, **SMALL)
    _, trainer, _ = run_scripted(cfg)
    for step, batch in enumerate(trainer.batches):
        versions = np.unique(batch.versions[batch.loss_mask > 0])
        assert versions.tolist() == [step - step % 2]


def test_the_guess_preset_trains_and_evaluates_episodes(tmp_path):
    cfg = presets.guess(
        **{**SMALL, "steps": 4, "log_every": 1, "eval_every": 4}, eval=dict(num_problems=8)
    )
    summary = run_lib.run(cfg, str(tmp_path), echo=lambda *_: None)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(train) == 4 and [r["step"] for r in evals] == [0, 4]  # at_start too
    for r in train:
        assert 1 <= r["episode/turns_mean"] <= 6 and r["episode/turns_max"] <= 6
        assert r["batch/observation_tokens"] > 0
        assert r["episode/error_frac"] == 0 and r["episode/timeout_frac"] == 0
        assert np.isfinite(r["loss"])
    assert all(1 <= r["episode/turns_mean"] <= 6 for r in evals)
    assert summary["eval/last"]["num_problems"] == 8


def test_episodes_across_processes_are_refused_in_one_line():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "launch.py", "--config=configs/guess.py", "--spawn_local=2"],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "multi-turn episodes run in one process" in lines[0]


def test_a_sampler_without_episodes_is_refused():
    from pipelinerl_jax.errors import ConfigError
    from pipelinerl_jax.pipeline.coordinator import Coordinator

    class OneTurnSampler:  # the seven protocol members, but no resume/release
        version = 0

    parts = dict.fromkeys(
        "trainer state stream encode_prompt detokenize reward_pool reward_table publisher "
        "admission writer".split()
    )
    with pytest.raises(ConfigError, match="needs a sampler that runs episodes"):
        Coordinator(presets.guess(), sampler=OneTurnSampler(), episodes=object(), **parts)
