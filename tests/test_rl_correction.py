"""Rollout correction (loss.correction) and the mismatch metrics against hand computations:
which tokens each mode masks, on stale tokens, fresh ones or both; a masked token has no
gradient and no loss; the metrics by hand; bad settings in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import pipeline, presets
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rl import correction, losses
from pipelinerl_jax.rl.batch import build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.rl.logprobs import full_logprobs
from tests.test_rl_losses import _samples

LP = np.array([-1.0, -2.0, -0.5, -1.5, -3.0], np.float32)
MU = np.array([-1.2, -2.0, -3.0, -1.0, -2.0], np.float32)  # log r = [.2, 0, 2.5, -.5, -1]
MASK = np.ones(5, np.float32)
SEQ = np.array([0, 0, 1, 1, 2])


def _keep(mode, applies="both", lag=(0, 0, 0, 0, 0), lo=0.5, hi=2.0):
    k = correction.keep_mask(
        mode, applies, lo, hi, LP, MU, MASK, jnp.asarray(lag), jnp.asarray(SEQ), 3
    )
    return np.asarray(k).tolist()


def test_token_mask_by_hand_on_stale_fresh_or_both():
    # [0.5, 2] in log space is [-0.693, 0.693]: tokens 2 (2.5) and 4 (-1) leave it.
    assert _keep("token_mask") == [1, 1, 0, 1, 0]
    lag = (0, 1, 1, 0, 0)  # tokens 1 and 2 were sampled a version before the trainer's
    assert _keep("token_mask", "staleness", lag) == [1, 1, 0, 1, 1]
    assert _keep("token_mask", "mismatch", lag) == [1, 1, 1, 1, 0]
    assert _keep("none") == [1] * 5


def test_sequence_modes_by_hand():
    # Sequences {0, 1}, {2, 3}, {4}: log-ratio sums .2, 2.0, -1; geometric means .1, 1.0, -1.
    assert _keep("sequence_mask") == [1, 1, 0, 0, 0]
    hi = float(np.exp(1.5))  # the geometric mean 1.0 is inside, the sum 2.0 is not
    assert _keep("sequence_mask", hi=hi) == [1, 1, 1, 1, 0]
    assert _keep("sequence_reject", hi=hi) == [1, 1, 0, 0, 0]
    # One stale token makes its whole sequence stale (a swap landed mid-answer).
    lag = (0, 0, 0, 1, 0)
    assert _keep("sequence_mask", "staleness", lag) == [1, 1, 0, 0, 1]
    assert _keep("sequence_mask", "mismatch", lag) == [1, 1, 1, 1, 0]


def test_metrics_by_hand():
    lag = jnp.asarray([0, 1, 1, 0, 0])
    keep = correction.keep_mask("token_mask", "both", 0.5, 2.0, LP, MU, MASK, lag)
    sums = correction.stats(LP, MU, MASK, lag, keep)
    m = correction.finalize(sums, jnp.sum(MASK), jnp.exp(2.5))
    assert float(m["correction/masked_frac"]) == pytest.approx(2 / 5)
    assert float(m["mismatch/tokens_frac"]) == pytest.approx(3 / 5)
    # Fresh tokens 0, 3, 4: |log r| = .2, .5, 1; k3 = e^x - 1 - x.
    assert float(m["mismatch/abs_mean"]) == pytest.approx((0.2 + 0.5 + 1.0) / 3, rel=1e-5)
    assert float(m["mismatch/abs_max"]) == pytest.approx(1.0)
    k3 = [np.exp(x) - 1 - x for x in (0.2, -0.5, -1.0)]
    assert float(m["mismatch/kl"]) == pytest.approx(np.mean(k3), rel=1e-5)
    # Ratio quantiles at bin edges: log r sorted -1, -.5, 0, .2, 2.5 (a fifth each).
    assert float(m["ratio/p05"]) == pytest.approx(np.exp(-0.5), rel=1e-6)  # bin [-1, -.5)
    assert float(m["ratio/p50"]) == pytest.approx(np.exp(0.01), rel=1e-6)  # bin [0, .01)
    assert float(m["ratio/p95"]) == pytest.approx(np.exp(4.0), rel=1e-6)  # bin [2, 4)


def _loss_and_grad(cfg, token_weights=None, version=3):
    batch_cfg = BatchConfig(seq_len=8, num_rows=4, max_sequences=6, max_sequence_len=6)
    b, _ = build_batch(_samples(), batch_cfg)
    # Versions 2 and 3 alternating: at the trainer's version 3, half the tokens are stale.
    alternating = np.arange(b.loss_mask.size).reshape(b.loss_mask.shape) % 2 + 2
    b = b.replace(versions=np.where(b.loss_mask > 0, alternating, 0).astype(np.int32))
    if token_weights is not None:
        b = b.replace(token_weights=token_weights)
    k = jax.random.split(jax.random.key(3), 2)
    h = jax.random.normal(k[0], b.tokens.shape + (8,))
    w = 0.3 * jax.random.normal(k[1], (8, 11))

    def f(h):
        loss, stats = losses.loss_from_hidden(cfg, h, w, b, num_sequences=6, version=version)
        return loss, losses.finalize(stats)

    return b, jax.jit(jax.value_and_grad(f, has_aux=True))(h)


# Bounds that mask some tokens of _samples() and not all (its sequences' mean log-ratios are
# -2.3, -1.8, -2.8, -0.4, -2.0, their sums -6.8, -9.0, -2.8, -0.8, -7.9).
BOUNDS = {
    "token_mask": (0.9, 1.1),
    "sequence_mask": (float(np.exp(-2.0)), 1.5),
    "sequence_reject": (float(np.exp(-5.0)), 1.5),
}


@pytest.mark.parametrize("mode", list(BOUNDS))
def test_a_masked_token_is_a_zero_weight_token(mode):
    """The corrected loss equals the uncorrected one with the masked tokens' weights zeroed
    by hand, gradient included (token_mask fused through the LM head, the sequence modes
    unfused)."""
    lo, hi = BOUNDS[mode]
    cfg = LossConfig(objective="ppo", correction=mode, correction_low=lo, correction_high=hi)
    assert cfg.fused == (mode == "token_mask")
    b, ((loss, m), g) = _loss_and_grad(cfg)
    assert 0 < float(m["correction/masked_frac"]) < 1  # the bounds mask some, not all
    # Which tokens: the keep mask from the uncorrected run's logprobs.
    plain = LossConfig(objective="ppo", token_chunk=cfg.token_chunk)
    k = jax.random.split(jax.random.key(3), 2)
    h = jax.random.normal(k[0], b.tokens.shape + (8,))
    lp, _ = full_logprobs(h, 0.3 * jax.random.normal(k[1], (8, 11)), b.targets)
    lag = jnp.where(b.loss_mask > 0, 3 - b.versions, 0)
    keep = correction.keep_mask(
        mode, "both", lo, hi, lp, b.behaviour_logprobs, b.loss_mask, lag, b.sequence_index, 6
    )
    _, ((loss_hand, _), g_hand) = _loss_and_grad(plain, b.token_weights * np.asarray(keep))
    np.testing.assert_allclose(loss, loss_hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, g_hand, rtol=1e-4, atol=1e-6)
    masked = float(m["correction/masked_frac"]) * float(m["tokens"])
    assert masked == pytest.approx(float(np.sum((1 - np.asarray(keep)) * b.loss_mask)))


def test_bad_correction_settings_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="loss.correction='clip'"):
        LossConfig(correction="clip")
    with pytest.raises(ConfigError, match="correction_applies='stale'"):
        LossConfig(correction="token_mask", correction_applies="stale")
    with pytest.raises(ConfigError, match="0 < low < 1 < high"):
        LossConfig(correction="token_mask", correction_low=1.2)


def test_a_run_reports_mismatch_and_correction_metrics(tmp_path):
    cfg = presets.tiny(steps=3, log_every=0, eval_every=0, loss={"correction": "token_mask"})
    pipeline.run(cfg, str(tmp_path), echo=lambda *_: None)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if '"kind": "train"' in line]
    for r in records:
        assert 0 <= r["correction/masked_frac"] <= 1 and 0 <= r["mismatch/tokens_frac"] <= 1
        assert r["mismatch/abs_max"] >= r["mismatch/abs_mean"] >= 0 and r["mismatch/kl"] >= 0
        assert r["ratio/p05"] <= r["ratio/p50"] <= r["ratio/p95"]
    # The first step trains tokens of version 0 at version 0: every token is fresh, and the
    # CPU sampler's logprobs match the trainer's closely.
    assert records[0]["mismatch/tokens_frac"] == 1.0 and records[0]["mismatch/abs_max"] < 1e-3
