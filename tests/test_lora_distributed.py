"""LoRA across processes (`--spawn_local=3`, a trainer over two processes and one sampler
process): the sampler builds its own frozen base and pulls adapter bytes only, held-out
evaluation gathers the whole model, the follower replays every step, and the checkpoint
records the base's fingerprint."""

import json
import re

import jax

from pipelinerl_jax import presets
from pipelinerl_jax.models import decoder, lora
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.train.checkpoint import RunCheckpointer
from tests.launching import launch

LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "down"]}


def test_lora_over_two_trainer_processes_and_a_sampler_process(tmp_path):
    workdir = tmp_path / "run"
    done = launch(
        "--config=configs/tiny.py",
        "--config.steps=4",
        "--config.checkpoint_every=4",
        "--config.eval_every=4",
        "--config.eval.num_problems=8",
        "--config.model.lora.rank=4",
        "--config.model.lora.alpha=8",
        '--config.model.lora.targets=["q", "v", "down"]',
        "--config.devices.trainer_processes=2",
        "--spawn_local=3",
        f"--workdir={workdir}",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "process 1 (trainer): stopped after 4 train steps" in done.stdout
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "eval"] == [4]
    # The sampler pulled adapters only: every version the same number of bytes, the adapters'.
    model_cfg = ModelConfig(**dict(presets.tiny_config().model.init), lora=LORA)
    _, abstract = decoder.abstract_init(model_cfg)
    adapters, base = lora.split(decoder.arrays(abstract))
    adapter_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adapters))
    base_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(base))
    line = next(x for x in done.stdout.splitlines() if "process 2 (sampler 0): stopped after" in x)
    pulls, pulled = map(int, re.search(r"(\d+) weight versions pulled, (\d+) bytes", line).groups())
    assert pulls >= 1 and pulled == pulls * adapter_bytes and adapter_bytes < base_bytes / 10
    ckpt = RunCheckpointer(workdir, read_only=True)
    try:
        assert ckpt.steps() == [4]
        assert len(ckpt.read_json(4, "extra")["lora_base"]["sha256"]) == 64
    finally:
        ckpt.close()
