"""The pipeline end to end: in-flight swaps land mid-sequence with correct version tags, the
lag bound holds in both modes, keep/recompute run, and the default config runs with held-out
evaluation at reduced size (that RL learns is test_rl_learns.py's claim, not this file's).

A scripted trainer alternates the policy between two known parameter sets (A at even
versions, B at odd ones), so every recorded token can be checked: replaying each sequence
token by token with the params of the version it is tagged with (and the prompt's K/V from the
version of its first token, as the sampler prefilled it) must reproduce the sampler's
behaviour logprobs. A token attributed to the wrong version would not.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default as default_config
from pipelinerl_jax.models import attention, decoder
from pipelinerl_jax.pipeline import components as build_lib
from pipelinerl_jax.pipeline import config_dict
from pipelinerl_jax.pipeline import runner as run_lib


def tiny_config(**overrides):
    c = default_config.get_config()
    c.steps = 6
    c.group_size = 4
    c.batch_size = 16
    c.max_lag = 1
    c.log_every = 0
    c.eval_every = 0
    c.batch.filter_zero_std_groups = False  # keep every sequence: the tests inspect them all
    c.generation.max_new_tokens = 12
    c.sampler.num_slots = 16
    c.sampler.max_seq_len = 24
    c.sampler.page_size = 16
    c.sampler.chunk_steps = 2
    c.model.init.update(
        hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16
    )
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return config_dict.from_config_dict(c)


@dataclasses.dataclass
class FakeState:
    params: object


class ScriptedTrainer:
    """Stands in for the Trainer: policy A at even versions, B at odd ones; keeps batches."""

    def __init__(self, params_a, params_b):
        self.params = (params_a, params_b)
        self.batches = []

    def params_of(self, version: int):
        return self.params[version % 2]

    def train_step(self, state, batch):
        self.batches.append(jax.tree.map(np.asarray, batch))
        version = len(self.batches)
        return FakeState(self.params_of(version)), {
            "loss": jnp.float32(0.0),
            "consecutive_skips": jnp.int32(0),
            "version": jnp.int32(version),
        }


def sequences_of(batch):
    """(all tokens, completion versions, behaviour logprobs) per packed sequence."""
    out = []
    for r in range(batch.tokens.shape[0]):
        for seg in np.unique(batch.segment_ids[r]):
            if seg == 0:
                continue
            idx = np.nonzero(batch.segment_ids[r] == seg)[0]
            mask = batch.loss_mask[r, idx] > 0
            tokens = batch.tokens[r, idx]  # prompt + completion
            out.append(
                (
                    tokens,
                    batch.versions[r, idx][mask],
                    batch.behaviour_logprobs[r, idx][mask],
                    int(np.argmax(mask)) + 1,
                )
            )
    return out


@functools.partial(jax.jit, static_argnums=0)
def _replay_step(graphdef, params, cache, token, pos):
    """One dense-cache decode step (cache [L, 1, S, K, D]) at position `pos`."""
    S = cache[0].shape[2]

    def attend(q, k, v, layer_cache):
        kc, vc = layer_cache
        kc = jax.lax.dynamic_update_slice_in_dim(kc, k, pos, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, v, pos, axis=1)
        mask = (jnp.arange(S) <= pos)[None, None, :]
        return attention.masked_attention(q, kc, vc, mask), (kc, vc)

    hidden, cache = decoder.forward_hidden(
        graphdef, params, token[None, None], pos[None, None], attend=attend, cache=cache
    )
    return jax.nn.log_softmax(decoder.logits_from_hidden(params, hidden)[0, 0]), cache


def replay_logprobs(graphdef, params_of, tokens, versions, prompt_len, max_len=32):
    """Token-by-token dense-cache decode where each position uses its own version's params."""
    cfg = decoder.config_of(graphdef)
    shape = (cfg.num_layers, 1, max_len, cfg.num_kv_heads, cfg.head_dim)
    cache = (jnp.zeros(shape), jnp.zeros(shape))
    logprobs = []
    for pos in range(len(tokens) - 1):
        j = pos - (prompt_len - 1)  # index of the completion token this step produces
        version = int(versions[max(j, 0)])
        lp, cache = _replay_step(
            graphdef, params_of(version), cache, jnp.int32(tokens[pos]), jnp.int32(pos)
        )
        if j >= 0:
            logprobs.append(float(lp[tokens[pos + 1]]))
    return np.array(logprobs)


def run_scripted(cfg):
    components = build_lib.build(cfg)
    graphdef = components.graphdef
    params_a = components.state.params
    params_b = decoder.init(decoder.config_of(graphdef), jax.random.key(99))[1]
    trainer = ScriptedTrainer(params_a, params_b)
    components.trainer, components.state = trainer, FakeState(params_a)
    summary = run_lib.run(cfg, None, components=components, echo=lambda *_: None)
    return summary, trainer, graphdef


@pytest.fixture(scope="module")
def keep_run():
    return run_scripted(tiny_config(max_lag=2, steps=8))


def test_in_flight_swaps_land_mid_sequence_with_correct_versions(keep_run):
    summary, trainer, graphdef = keep_run
    assert summary["sampler/swaps"] >= 3
    seqs = [s for b in trainer.batches for s in sequences_of(b)]
    mixed = [s for s in seqs if len(set(s[1])) > 1]
    assert mixed, "no sequence saw a weight swap mid-generation"
    for _tokens, versions, _behaviour, _prompt_len in seqs:
        assert np.all(np.diff(versions) >= 0)  # versions never go back within a sequence
    # Replay every mixed sequence and a few single-version ones.
    for tokens, versions, behaviour, prompt_len in mixed + seqs[:4]:
        replayed = replay_logprobs(graphdef, trainer.params_of, tokens, versions, prompt_len)
        np.testing.assert_allclose(behaviour, replayed, atol=2e-4, rtol=2e-4)
    # The replay can fail: attributing tokens to the other version changes the logprobs.
    tokens, versions, behaviour, prompt_len = mixed[0]
    wrong = replay_logprobs(graphdef, trainer.params_of, tokens, versions + 1, prompt_len)
    assert np.abs(wrong - behaviour).max() > 1e-2


def _check_lag(summary, trainer, max_lag):
    for step, batch in enumerate(trainer.batches):
        lags = step - batch.versions[batch.loss_mask > 0]
        assert lags.min() >= 0 and lags.max() <= max_lag
    assert summary["lag/token_max"] <= max_lag


def test_lag_never_exceeds_max_lag(keep_run):
    summary, trainer, _ = keep_run
    _check_lag(summary, trainer, 2)


def test_max_lag_zero_is_strictly_on_policy():
    summary, trainer, _ = run_scripted(tiny_config(max_lag=0, steps=4))
    _check_lag(summary, trainer, 0)
    assert summary["seq/mixed_version_frac"] == 0


def test_conventional_rounds_use_one_version_and_lag_below_round():
    cfg = tiny_config(mode="conventional", conventional_steps=3, steps=6)
    summary, trainer, _ = run_scripted(cfg)
    for step, batch in enumerate(trainer.batches):
        versions = np.unique(batch.versions[batch.loss_mask > 0])
        assert versions.tolist() == [step - step % 3]
    assert summary["lag/token_max"] == 2


def test_recompute_policy_matches_new_params_over_the_full_prefix():
    """kv_policy=recompute re-prefills running sequences after a swap, so every token is
    explained by the params of its own version over the WHOLE prefix (not a mixed cache)."""
    cfg = tiny_config(max_lag=2, **{"sampler.kv_policy": "recompute"})
    summary, trainer, graphdef = run_scripted(cfg)
    seqs = [s for b in trainer.batches for s in sequences_of(b)]
    mixed = [s for s in seqs if len(set(s[1])) > 1]
    assert mixed
    cfg_model = decoder.config_of(graphdef)
    for tokens, versions, behaviour, prompt_len in mixed[:6]:
        for j, version in enumerate(versions):
            n = prompt_len + j  # the prefix that produced completion token j
            padded = np.zeros(32, np.int32)
            padded[:n] = tokens[:n]  # causal: what follows position n-1 cannot change it
            logits = decoder.jit_forward(
                graphdef,
                trainer.params_of(int(version)),
                jnp.asarray(padded[None]),
                jnp.arange(32)[None],
            )
            lp = jax.nn.log_softmax(logits[0, n - 1])[tokens[n]]
            np.testing.assert_allclose(behaviour[j], float(lp), atol=2e-4, rtol=2e-4)
    assert cfg_model.vocab_size == 16


def test_default_config_runs_end_to_end_at_reduced_size(tmp_path):
    cfg = tiny_config(steps=12, max_lag=2, eval_every=6, **{"eval.num_problems": 8})
    lines = []
    summary = run_lib.run(cfg, str(tmp_path), echo=lines.append)
    assert summary["steps"] == 12
    assert summary["sampler/swaps"] >= 1 and summary["lag/token_max"] <= 2
    assert sum(summary["lag/hist"].values()) > 0
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "config.json").exists()
    assert lines[-1].startswith("done: 12 steps")
    # Held-out evaluation at steps 6 and 12, in the log and in the summary.
    assert [step for step, _ in summary["eval/avg@k_by_step"]] == [6, 12]
    # avg@k recounted from the eval record's own per-status counts (8 problems x k = 1),
    # and the same number in the summary and the console line.
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [6, 12]
    for record, (_, avg) in zip(evals, summary["eval/avg@k_by_step"]):
        assert record["num_problems"] == 8 and sum(record["status"].values()) == 8
        assert avg == record["avg@k"] == record["status"]["correct"] / 8
        assert f"eval at step {record['step']}: avg@1 {avg:.3f} " in "\n".join(lines)
