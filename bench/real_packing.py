"""The real model's train step with and without shared prompts, on the same samples.

    make real-model                  # once
    python bench/real_packing.py     # ~3 min on 2 cores

configs/smollm2_math.py trains 16 attempts a step: 4 prompts of ~110-131 tokens (the one-shot
chat prompt) x 4 completions (median ~55 tokens, up to 144). Both layouts train the same
batches, built from the same samples (random token ids with that length distribution; the
step's cost does not depend on the ids), with the config's remat, objective and AdamW:

- shared: the config as it ships, a group's attempts after one copy of its prompt, in rows of
  448 tokens, one row per micro-batch (16), empty micro-batches skipped;
- one copy per attempt: every sample in its own 288-token row, 16 rows, one micro-batch.

Reports the median step time of 3 steps after a warm-up step, the rows and tokens trained,
and peak RSS per layout (each in its own process). Writes bench/results/real_packing.json.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = common.REAL_MODEL_DIR
ROUNDS = 3


def samples(rng, groups: int = 4, group_size: int = 4, vocab: int = 49152):
    from pipelinerl_jax.rl.batch import ScoredSample

    out = []
    for g in range(groups):
        prompt = rng.integers(0, vocab, int(rng.integers(110, 132))).tolist()
        for _ in range(group_size):
            c = int(min(144, max(8, rng.lognormal(3.0, 0.6) + 35)))
            out.append(
                ScoredSample(
                    prompt,
                    rng.integers(0, vocab, c).tolist(),
                    (-rng.random(c)).tolist(),
                    [0] * c,
                    float(rng.random()),
                    g,
                    True,
                )
            )
    return out


def worker(layout: str, out: Path) -> None:
    import jax
    import numpy as np

    from configs import smollm2_math
    from pipelinerl_jax.models import hf_io
    from pipelinerl_jax.pipeline.config_dict import from_config_dict
    from pipelinerl_jax.rl.batch import build_batch
    from pipelinerl_jax.train import trainer as tr

    cfg = from_config_dict(smollm2_math.get_config())
    bcfg, tcfg = cfg.batch, cfg.trainer
    if layout == "unshared":
        bcfg = dataclasses.replace(bcfg, share_prompts=False, seq_len=288, num_rows=16)
        tcfg = dataclasses.replace(tcfg, micro_batches=1)
    _, graphdef, params = hf_io.load_hf(MODEL_DIR, param_dtype="float32", remat=True)
    trainer = tr.Trainer(tcfg, graphdef, jax.eval_shape(lambda: params), tr.trainer_mesh())
    state = trainer.init_state(params)
    rng = np.random.default_rng(0)  # the same samples for both layouts
    times, rows, tokens = [], [], []
    for r in range(ROUNDS + 1):
        batch, stats = build_batch(samples(rng), bcfg)
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        if r:  # the first step compiles
            times.append(time.perf_counter() - t0)
            rows.append(stats["rows_used"])
            tokens.append(
                stats["rows_used"] * bcfg.seq_len
                if tcfg.micro_batches == bcfg.num_rows
                else bcfg.num_rows * bcfg.seq_len
            )
    out.write_text(
        json.dumps(
            {
                "layout": layout,
                "seq_len": bcfg.seq_len,
                "num_rows": bcfg.num_rows,
                "micro_batches": tcfg.micro_batches,
                "step_s": statistics.median(times),
                "steps_s": times,
                "rows_used": rows,
                "tokens_computed": tokens,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
        )
    )


def main() -> None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("shared", "unshared"))
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.out))
    common.require_model(MODEL_DIR)
    load = common.warn_if_busy()
    results = {}
    for layout in ("shared", "unshared"):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run(
                [sys.executable, __file__, f"--worker={layout}", f"--out={f.name}"],
                cwd=ROOT,
                check=True,
            )
            results[layout] = json.loads(Path(f.name).read_text())
        r = results[layout]
        print(
            f"{layout}: {r['step_s']:.1f} s a step, rows used {r['rows_used']}, "
            f"peak RSS {r['peak_rss_gib']:.2f} GiB"
        )
    speedup = results["unshared"]["step_s"] / results["shared"]["step_s"]
    print(f"shared prompts: {speedup:.2f}x faster train step")
    common.write_result("real_packing", {"load_before": load, **results, "speedup": speedup})


if __name__ == "__main__":
    main()
