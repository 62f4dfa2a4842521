"""`launch.py --dry_run --gpu=h100`: a run config's roles on a GPU, through the planner's report.

The demo config and configs/smollm2_math.py (its model's config.json written from
models/known_shapes.py, no weights) end to end in-process; the printed memory lines are those
gpu_memory gives for the config's own shapes; the layout of a multi-device split; bad --gpu
requests and a role that does not fit are one line with exit code 2.
"""

import json
from pathlib import Path

import pytest
from absl import flags
from absl import logging as absl_logging

import launch
from pipelinerl_jax import config_cli
from pipelinerl_jax.models.known_shapes import KNOWN_HF_CONFIGS
from pipelinerl_jax.pipeline import config_dict, host_memory
from pipelinerl_jax.pipeline.components import model_config
from pipelinerl_jax.plan import gpu_memory, gpu_run
from pipelinerl_jax.plan.gpu_specs import gpu_spec

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = f"--config={ROOT / 'configs' / 'smollm2_math.py'}"
H100 = gpu_spec("h100")


@pytest.fixture(autouse=True)
def _fresh_flags():
    verbosity = absl_logging.get_verbosity()
    yield
    flags.FLAGS.unparse_flags()  # the next in-process launch parses from scratch
    absl_logging.set_verbosity(verbosity)


@pytest.fixture
def smollm2_dir(tmp_path):
    """A model directory with SmolLM2-135M's config.json only: the dry run reads no weights."""
    (tmp_path / "config.json").write_text(json.dumps(KNOWN_HF_CONFIGS["smollm2-135m"]))
    return tmp_path


def _launch(*args, capsys):
    """(exit code, stdout, stderr) of launch.py with these arguments, in-process."""
    with pytest.raises(SystemExit) as e:
        launch.launch(["launch.py", *args])
        raise SystemExit(0)
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err


def _gpu_lines(out: str) -> dict:
    """The GPU section's lines by their first word(s)."""
    section = out[out.index("--gpu=") :].splitlines()
    return {line.split(":")[0]: line for line in section}


def test_demo_config_on_h100(capsys):
    code, out, err = _launch("--dry_run", "--gpu=h100", capsys=capsys)
    assert code == 0, err
    lines = _gpu_lines(out)
    assert "predicted (roofline) on NVIDIA H100 80GB HBM3" in lines["--gpu=h100"]
    assert "one device shared by sampler and trainer" in lines["--gpu=h100"]
    for role in ("sampler", "trainer", "sampler + trainer"):
        assert lines[role].startswith(f"{role}: fits in 80 GB: yes"), lines[role]
    assert "decode step, predicted (roofline)" in lines
    assert "train step, predicted (roofline)" in lines
    assert "0.00 ms" not in out  # a toy model's microseconds keep two significant digits
    assert out.rstrip().endswith("nothing was loaded or compiled")


def test_smollm2_math_on_h100_uses_the_configs_shapes(smollm2_dir, capsys):
    hf_dir = f"--config.model.hf_dir={smollm2_dir}"
    code, out, err = _launch(SMOLLM2, hf_dir, "--dry_run", "--gpu=h100", capsys=capsys)
    assert code == 0, err
    lines = _gpu_lines(out)
    # The config's own shapes (configs/smollm2_math.py): 16 slots of 288 tokens in pages of
    # 16, plus the null page; 16 rows of 448 in 16 one-row micro-batches; f32, remat.
    c = config_cli.load_file(str(ROOT / "configs" / "smollm2_math.py"))
    config_cli.apply_overrides(c, config_cli.split_argv([hf_dir])[1])
    cfg = config_dict.from_config_dict(c)
    model_cfg = model_config(cfg)
    assert (cfg.sampler.num_slots, cfg.sampler.max_seq_len, cfg.batch.num_rows) == (16, 288, 16)
    assert "16 slots and 4624 KV tokens each" in lines["layout"]
    assert "decode timed at context 216" in lines["layout"]
    sampler = gpu_memory.memory_per_device(
        model_cfg,
        "sampler",
        tp=1,
        batch=16,
        context_len=288,
        kv_tokens=(16 * 288 // 16 + 1) * 16,
        weight_dtype="float32",
        cache_dtype="float32",
        head_dtype="float32",
    )
    trainer = gpu_memory.memory_per_device(model_cfg, "trainer", fsdp=1, rows=1, seq_len=448)
    assert lines["sampler"] == sampler.describe(H100)
    assert lines["trainer"] == trainer.describe(H100)
    assert (
        "16 x 448 tokens per device, FSDP over 1 devices"
        in lines["train step, predicted (roofline)"]
    )
    assert "for 16 sequences on 1 device(s)" in lines["decode step, predicted (roofline)"]


def test_a_multi_device_split(smollm2_dir):
    """6 sampler devices in 2 replicas of tp 3 (8 slots each), 2 trainer devices."""
    c = config_cli.load_file(str(ROOT / "configs" / "smollm2_math.py"))
    overrides = [
        f"--config.model.hf_dir={smollm2_dir}",
        "--config.devices.sampler_tp=3",
        "--config.model.compute_dtype=bfloat16",
    ]
    config_cli.apply_overrides(c, config_cli.split_argv(overrides)[1])
    cfg = config_dict.from_config_dict(c)
    report = gpu_run.gpu_report(
        cfg, model_config(cfg), gpu_spec("h200"), sampler_devices=6, trainer_devices=2
    )
    assert report.problem is None
    text = "\n".join(report.lines)
    assert "on 6 sampler + 2 trainer devices" in text and "sampler + trainer:" not in text
    assert "2 replica(s) of tp 3, 8 slots and 2320 KV tokens each" in text  # (8 x 18 + 1) x 16
    assert "for 8 sequences on 3 device(s)" in text
    assert "8 x 448 tokens per device, FSDP over 2 devices" in text
    assert "fits in 141 GB: yes" in text


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--dry_run", "--gpu=a100"],
            "error: --gpu=a100: unknown GPU; use one of ['h100', 'h200']",
        ),
        (["--gpu=h100"], "error: --gpu=h100 is for --dry_run: add --dry_run, or leave --gpu out"),
    ],
)
def test_bad_gpu_requests_are_one_line_and_exit_2(args, expected, capsys):
    code, out, err = _launch(*args, capsys=capsys)
    assert code == 2 and err == expected + "\n", err
    assert out == ""


def test_a_role_that_does_not_fit_is_refused_after_its_lines(capsys, monkeypatch):
    # ~26B f32 parameters: fits no H100 with its optimizer state; this host's own check is
    # taken out of the way (it would refuse first on a small machine).
    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
    big = ["--config.model.init.hidden_size=8192", "--config.model.init.num_layers=32"]
    big += ["--config.model.init.intermediate_size=28672", "--config.model.init.num_heads=64"]
    code, out, err = _launch("--dry_run", "--gpu=h100", *big, capsys=capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("config error: --gpu=h100: the sampler does not fit: "), err
    assert "usable on h100; lower config.sampler.num_slots" in err
    assert "sampler: fits in 80 GB: no" in out and "nothing was loaded" not in out
