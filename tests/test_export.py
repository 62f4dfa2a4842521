"""`python -m pipelinerl_jax.export`: run checkpoint -> Hugging Face directory.

Round trip through transformers: the exported directory, loaded by
AutoModelForCausalLM, gives the logits of our forward on the checkpoint's params (f32, same
bound as tests/test_hf_io.py). Also: an older --step, a checkpoint without a recorded model
config (shape from config.json), --dtype, tokenizer files, and one-line exit-2 errors.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pipelinerl_jax import export
from pipelinerl_jax.models import decoder, hf_io
from pipelinerl_jax.train import checkpoint as ck
from pipelinerl_jax.train.trainer import TrainState
from tests.tiny_models import model_config

CFG = model_config(vocab_size=48, bos_token_id=1, eos_token_id=2)


def random_params(seed):
    """Random weights, norms around 1 (so that they matter in the comparison)."""
    _, params = decoder.abstract_init(CFG)
    rng = np.random.default_rng(seed)

    def one(path, x):
        name = jax.tree_util.keystr(path)
        base = 1.0 if "norm" in name else 0.0
        return jnp.asarray(base + 0.2 * rng.standard_normal(x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def train_state(params, step):
    opt_state = optax.adam(1e-3).init(params)
    z = lambda v: jnp.asarray(v, jnp.int32)
    return TrainState(
        step=z(step),
        version=z(step),
        params=params,
        opt_state=opt_state,
        ref_params=None,
        skipped=z(0),
        consecutive_skips=z(0),
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run with checkpoints at steps 1 and 2 (different params)."""
    workdir = tmp_path_factory.mktemp("run")
    with ck.RunCheckpointer(workdir, model_config=CFG) as ckpt:
        for step in (1, 2):
            ckpt.save(step, train_state(random_params(step), step), {"step": step})
    return workdir


def _run(argv, capsys):
    code = export.run_cli(["export"] + argv)
    return code, capsys.readouterr().err


def test_export_round_trip_through_transformers(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    code, err = _run([f"--workdir={run_dir}", f"--out={out}"], capsys)
    assert code == 0, err
    assert f"exported step 2 of {run_dir}" in err
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.float().numpy()
    graphdef, _ = decoder.abstract_init(CFG)
    positions = np.broadcast_to(np.arange(12), (2, 12))
    ours = np.asarray(
        decoder.jit_forward(graphdef, random_params(2), jnp.asarray(tokens), jnp.asarray(positions))
    )
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-6
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def _assert_params_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_export_older_step(run_dir, tmp_path, capsys):
    out = tmp_path / "hf1"
    code, err = _run([f"--workdir={run_dir}", f"--out={out}", "--step=1"], capsys)
    assert code == 0, err
    cfg, _, params = hf_io.load_hf(out)
    assert cfg == CFG
    _assert_params_equal(params, random_params(1))


def _tokenizer_dir(path):
    path.mkdir()
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "[UNK]", "a", "b"])}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


def test_model_from_run_config_dtype_and_tokenizer(tmp_path, capsys):
    """No model config in the checkpoint: config.json's model.init gives the shape; the
    tokenizer comes from the run's model.hf_dir; --dtype casts."""
    workdir = tmp_path / "run"
    with ck.RunCheckpointer(workdir) as ckpt:  # no model_config recorded
        ckpt.save(4, train_state(random_params(4), 4), {})
    hf_dir = _tokenizer_dir(tmp_path / "base")
    fields = {f.name: getattr(CFG, f.name) for f in dataclasses.fields(CFG)}
    init = sorted((k, v) for k, v in fields.items() if k not in ("param_dtype", "compute_dtype"))
    (workdir / "config.json").write_text(
        json.dumps(
            {
                "model": {
                    "hf_dir": str(hf_dir),
                    "param_dtype": "float32",
                    "compute_dtype": "float32",
                    "init": init,
                }
            }
        )
    )
    out = tmp_path / "hf"
    code, err = _run([f"--workdir={workdir}", f"--out={out}", "--dtype=bfloat16"], capsys)
    assert code == 0, err
    assert (out / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()
    assert (out / "tokenizer_config.json").exists()
    cfg, _, params = hf_io.load_hf(out, param_dtype="bfloat16")
    assert cfg == dataclasses.replace(CFG, param_dtype="bfloat16", compute_dtype="bfloat16")
    want = jax.tree.map(lambda x: x.astype(jnp.bfloat16), random_params(4))
    _assert_params_equal(params, want)


def test_bad_inputs(run_dir, tmp_path, capsys):
    cases = [
        ([f"--workdir={tmp_path / 'nope'}", f"--out={tmp_path / 'o'}"], "directory does not exist"),
        ([f"--workdir={tmp_path}", f"--out={tmp_path / 'o'}"], "no checkpoints"),
        (
            [f"--workdir={run_dir}", f"--out={tmp_path / 'o'}", "--step=7"],
            "available steps: [1, 2]",
        ),
        ([f"--workdir={run_dir}"], "--out is required"),
        (
            [f"--workdir={run_dir}", f"--out={tmp_path / 'o'}", f"--tokenizer_dir={tmp_path}"],
            "no tokenizer.json",
        ),
        ([f"--workdir={run_dir}", "--out=x", "--dtype=float16"], "dtype"),
    ]
    for argv, message in cases:
        code, err = _run(argv, capsys)
        assert code == 2, (argv, err)
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, err
    assert not (tmp_path / "o").exists()


def test_an_out_holding_the_users_files_is_refused_and_kept(run_dir, tmp_path, capsys):
    """An export replaces its directory whole: over an earlier export (its adapter/ and stale
    shards included) that is what a re-export wants; over anything else it would delete the
    user's files, so it is refused before the checkpoint loads, and they stay."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (mine / "sub" / "data.csv").write_text("1,2")
    code, err = _run([f"--workdir={run_dir}", f"--out={mine}"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "holds 'sub/data.csv' and 1 more, which no model export writes" in err, err
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert (mine / "sub" / "data.csv").read_text() == "1,2"
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    code, err = _run([f"--workdir={run_dir}", f"--out={a_file}"], capsys)
    assert code == 2 and "exists and is not a directory" in err and a_file.read_text() == "keep"
    # An earlier export, with a LoRA run's adapter/ and a stale shard: replaced whole.
    out = tmp_path / "hf"
    code, err = _run([f"--workdir={run_dir}", f"--out={out}", "--step=1"], capsys)
    assert code == 0, err
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text("{}")
    (out / "model-00002-of-00002.safetensors").write_text("stale")
    code, err = _run([f"--workdir={run_dir}", f"--out={out}"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    _assert_params_equal(hf_io.load_hf(out)[2], random_params(2))


def test_every_file_a_writer_makes_counts_as_an_earlier_exports():
    from pipelinerl_jax.models import gguf_io, peft_io

    written = {
        peft_io.CONFIG_FILE,
        peft_io.WEIGHTS_FILE,
        gguf_io.SOURCE_FILE,
        *hf_io.TOKENIZER_FILES,
    }
    assert written <= hf_io.EXPORT_FILES


def test_module_entry_point_exit_code(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelinerl_jax.export",
            f"--workdir={tmp_path}",
            f"--out={tmp_path / 'o'}",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=120,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[-1].startswith("error: ") and "no checkpoints" in out.stderr
    )
