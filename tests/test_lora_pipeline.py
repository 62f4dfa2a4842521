"""LoRA runs end to end (model.lora): pipeline and conventional mode train adapters only,
publish adapter bytes only, checkpoint the adapters with their base's fingerprint, resume,
refuse a resume onto other base weights in one line, and export the merged model."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import export, pipeline, presets
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, hf_io, lora
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.train.checkpoint import RunCheckpointer

LORA = {"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
QUIET = dict(log_every=0, eval_every=0)


def _save_base(path, seed):
    """A tiny random model as a Hugging Face directory: the run's frozen base."""
    model_cfg = ModelConfig(**dict(presets.tiny_config().model.init))
    _, params = decoder.init(model_cfg, jax.random.key(seed))
    hf_io.save_hf(path, model_cfg, params)
    return decoder.arrays(params)


def _cfg(base_dir, **overrides):
    return presets.tiny(model=dict(hf_dir=str(base_dir), init={}, lora=LORA), **overrides)


def test_pipeline_run_trains_adapters_publishes_them_resumes_and_exports(tmp_path):
    seed = random.Random().randrange(1 << 16)
    base_arrays = _save_base(tmp_path / "base", seed)
    run = tmp_path / "run"
    cfg = _cfg(tmp_path / "base", steps=4, checkpoint_every=2, seed=seed, **QUIET)
    c = pipeline.build(cfg)
    summary = pipeline.run(cfg, str(run), components=c, echo=lambda *_: None)
    assert summary["steps"] == 4
    # The base never moved, bit for bit; the adapters did.
    jax.tree.map(np.testing.assert_array_equal, decoder.arrays(c.trainer.frozen), base_arrays)
    adapters = jax.device_get(c.state.params)
    assert float(np.abs(adapters["layers"]["v_proj_lora_b"]).max()) > 0
    # Every swap moved the adapters alone.
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    assert c.sampler._view.last_bytes == adapter_bytes
    assert adapter_bytes < sum(x.nbytes for x in jax.tree.leaves(base_arrays)) / 3

    ckpt = RunCheckpointer(run, read_only=True)
    try:
        assert ckpt.steps() == [2, 4]
        assert ckpt.read_json(4, "extra")["lora_base"]["sha256"] == lora.fingerprint(base_arrays)
    finally:
        ckpt.close()

    # Export: the merged model, as transformers would load it, computes the adapted model.
    out = export.export(str(run), str(tmp_path / "merged"))
    assert out["step"] == 4
    model_cfg, graphdef, merged = hf_io.load_hf(tmp_path / "merged")
    assert model_cfg.lora is None
    tokens = jax.random.randint(jax.random.key(seed), (2, 7), 0, model_cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    full = lora.merge(decoder.arrays(c.state.params), decoder.arrays(c.trainer.frozen))
    np.testing.assert_allclose(
        decoder.forward(graphdef, merged, tokens, positions),
        decoder.forward(c.graphdef, full, tokens, positions),
        atol=1e-5,
        rtol=0,
    )

    # Resuming trains on from step 4, on the same base.
    longer = _cfg(tmp_path / "base", steps=6, checkpoint_every=2, seed=seed, **QUIET)
    lines = []
    assert pipeline.run(longer, str(run), echo=lines.append)["steps"] == 6
    assert any(line.startswith("resumed from step 4") for line in lines)
    # Other weights under the same hf_dir: the adapters would not fit them. Refused, one line.
    _save_base(tmp_path / "base", seed + 1)
    again = _cfg(tmp_path / "base", steps=8, checkpoint_every=2, seed=seed, **QUIET)
    with pytest.raises(ConfigError) as err:
        pipeline.run(again, str(run), echo=lambda *_: None)
    message = str(err.value)
    assert "trained on other base weights" in message and "\n" not in message
    with pytest.raises(ConfigError, match="trained on other base weights"):
        export.export(str(run), str(tmp_path / "merged2"))
    assert not (tmp_path / "merged2").exists()


def test_conventional_mode_trains_adapters_with_evaluation(tmp_path):
    seed = random.Random().randrange(1 << 16)
    base_arrays = _save_base(tmp_path / "base", seed)
    cfg = presets.tiny(
        model=dict(hf_dir=str(tmp_path / "base"), init={}, lora=LORA),
        steps=3,
        mode="conventional",
        seed=seed,
        log_every=0,
        eval_every=3,
        eval={"num_problems": 4},
    )
    c = pipeline.build(cfg)
    summary = pipeline.run(cfg, None, components=c, echo=lambda *_: None)
    assert summary["steps"] == 3
    jax.tree.map(np.testing.assert_array_equal, decoder.arrays(c.trainer.frozen), base_arrays)
    assert set(c.state.params["layers"]) == {
        f"{t}{s}" for t in lora.TARGETS for s in (lora.SUFFIX_A, lora.SUFFIX_B)
    }
