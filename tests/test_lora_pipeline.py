"""LoRA runs end to end (model.lora): pipeline and conventional mode train adapters only,
publish adapter bytes only, checkpoint the adapters with their base's fingerprint, resume,
refuse a resume onto other base weights in one line, and export the merged model."""

import os
import random
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import export, pipeline, presets
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, hf_io, lora, shared_base
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.train.checkpoint import RunCheckpointer

LORA = {"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
QUIET = dict(log_every=0, eval_every=0)
ROOT = Path(__file__).resolve().parents[1]


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
    assert isinstance(c.trainer.frozen, shared_base.SharedBase)  # one device: one copy
    jax.tree.map(np.testing.assert_array_equal, c.trainer.stored_base(), base_arrays)
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
    full = lora.merge(decoder.arrays(c.state.params), c.trainer.stored_base())
    np.testing.assert_allclose(
        decoder.forward(graphdef, merged, tokens, positions),
        decoder.forward(c.graphdef, full, tokens, positions),
        atol=1e-5,
        rtol=0,
    )

    # The adapter in PEFT's format: peft puts it on the base and computes the same logits.
    torch, peft, transformers = (pytest.importorskip(m) for m in ("torch", "peft", "transformers"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", torch_dtype=torch.float32
    )
    peft_model = peft.PeftModel.from_pretrained(hf_model, out["adapter"]).eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(
        theirs, decoder.forward(c.graphdef, full, tokens, positions), atol=1e-5, rtol=0
    )
    # ... and a new run can start from it (model.lora_init): the same adapters, rank and alpha.
    start = presets.tiny(
        model=dict(hf_dir=str(tmp_path / "base"), init={}, lora_init=out["adapter"]), **QUIET
    )
    started = pipeline.build(start)
    assert decoder.config_of(started.graphdef).lora == decoder.config_of(c.graphdef).lora
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(started.state.params), adapters)

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
    assert isinstance(c.trainer.frozen, shared_base.SharedBase)  # one device: one copy
    jax.tree.map(np.testing.assert_array_equal, c.trainer.stored_base(), base_arrays)
    assert set(c.state.params["layers"]) == {
        f"{t}{s}" for t in lora.TARGETS for s in (lora.SUFFIX_A, lora.SUFFIX_B)
    }


def test_bad_lora_settings_are_one_line_with_exit_code_2(tmp_path):
    with pytest.raises(ConfigError, match="no adapter_config.json there") as err:
        presets.tiny(model=dict(lora_init=str(tmp_path)))
    assert "\n" not in str(err.value)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "--config=configs/tiny.py",
            "--config.model.lora.rank=4",
            '--config.model.lora.targets=["q", "lm_head"]',
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "'lm_head' is not a projection" in proc.stderr


def test_peft_out_for_a_full_fine_tune_is_refused_before_writing(tmp_path):
    cfg = presets.tiny(steps=1, checkpoint_every=1, **QUIET)
    pipeline.run(cfg, str(tmp_path / "run"), echo=lambda *_: None)
    with pytest.raises(ConfigError, match="is not a LoRA run"):
        export.export(str(tmp_path / "run"), str(tmp_path / "out"), peft_out=str(tmp_path / "a"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "a").exists()


@pytest.mark.parametrize("peft_out", ["out", "out/x", "."])
def test_peft_out_overlapping_out_is_refused_before_loading(tmp_path, peft_out):
    """--peft_out = --out (or either inside the other) replaced the merged model with the
    adapter, or removed it; the default <out>/adapter stays allowed."""
    out, adapter = tmp_path / "out", tmp_path / peft_out
    with pytest.raises(ConfigError, match="overlap, so one write would replace the other"):
        export.export(str(tmp_path / "no_run"), str(out), peft_out=str(adapter))
    assert not out.exists()
    export._check_apart(out, out / "adapter")
    export._check_apart(out, tmp_path / "adapter")


def test_dry_run_checks_lora_init_as_the_run_would(tmp_path):
    """The adapter's config and tensor shapes are read from the file headers: a rank that
    differs from model.lora's, or an unreadable weights file, is refused before a run."""
    from pipelinerl_jax.dry_run import dry_run
    from pipelinerl_jax.models import peft_io
    from pipelinerl_jax.pipeline.components import model_config

    cfg = presets.tiny(model=dict(lora=LORA))
    model_cfg = model_config(cfg)
    _, params = decoder.init(model_cfg, jax.random.key(random.Random().randrange(1 << 16)))
    peft_io.save_peft(model_cfg, params, tmp_path / "a")
    quiet = lambda *_: None
    dry_run(presets.tiny(model=dict(lora_init=str(tmp_path / "a"))), echo=quiet)
    other_rank = dict(LORA, rank=2)
    with pytest.raises(ConfigError, match="r=4 but model.lora rank=2; leave model.lora unset"):
        dry_run(
            presets.tiny(model=dict(lora=other_rank, lora_init=str(tmp_path / "a"))), echo=quiet
        )
    (tmp_path / "a" / peft_io.WEIGHTS_FILE).write_bytes(os.urandom(64))
    with pytest.raises(ConfigError, match="cannot read safetensors file"):
        dry_run(presets.tiny(model=dict(lora_init=str(tmp_path / "a"))), echo=quiet)
