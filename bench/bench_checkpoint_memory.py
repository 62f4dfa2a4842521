"""What saving a checkpoint of the real config's train state costs in memory and time on CPU.

    make real-model
    python bench/bench_checkpoint_memory.py            # 3 rounds of each form
    python bench/bench_checkpoint_memory.py --rounds=1

configs/smollm2_math.py's train state (SmolLM2-135M-Instruct in f32 with its AdamW moments,
1.5 GB) is saved by `RunCheckpointer` in three forms, each in a fresh process (so one form's
freed pages cannot serve the next), in alternating order:

- `async`: Orbax's background write, the default on accelerators, where the host copy lives
  outside the device's memory. On CPU it is a second state in the same memory;
- `sync_unbounded`: written before `save` returns, every leaf in flight at once;
- `sync_bounded`: the CPU default, written before `save` returns with at most
  `checkpoint.inflight_bytes_for(model)` in flight (two of the largest leaves).

Right after `save` returns, a jitted update that donates the state runs, as the next train
step does. Reported per form: the process's peak RSS above what it held before the save
(sampled every 10 ms), the seconds until `save` returned and until the files were complete.

Writes bench/results/checkpoint_memory.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = common.REAL_MODEL_DIR
FORMS = ("async", "sync_unbounded", "sync_bounded")
GiB = 2**30


def one_save(form: str, workdir: str) -> dict:
    """In this process: the real train state, one save in `form`, one donating update."""
    import os
    import time

    from bench.rss_trace import RssTrace, rss_bytes
    from pipelinerl_jax import glibc_malloc

    glibc_malloc.limit_arenas()  # as launch.py does, before JAX starts its threads

    import jax

    from pipelinerl_jax import presets
    from pipelinerl_jax.models import decoder, hf_io
    from pipelinerl_jax.pipeline import components, config_dict
    from pipelinerl_jax.train import checkpoint as ck
    from pipelinerl_jax.train import trainer as tr

    cfg = config_dict.from_config_dict(presets.smollm2_math_config())
    model_cfg = components.model_config(cfg)
    _, _, params = hf_io.load_hf(
        MODEL_DIR, param_dtype=model_cfg.param_dtype, compute_dtype=model_cfg.compute_dtype
    )
    graphdef, abstract = decoder.abstract_init(model_cfg)
    trainer = tr.Trainer(cfg.trainer, graphdef, abstract, tr.trainer_mesh())
    state = trainer.init_state(params)
    del params
    # The next train step, as far as the saved buffers are concerned: it donates them.
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1 if x.ndim else x, s), donate_argnums=0)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

    kwargs = {
        "async": dict(async_save=True),
        "sync_unbounded": dict(async_save=False),
        "sync_bounded": dict(
            async_save=False, save_inflight_bytes=ck.inflight_bytes_for(model_cfg)
        ),
    }[form]
    ckpt = ck.RunCheckpointer(workdir, **kwargs)
    jax.block_until_ready(state)
    glibc_malloc.release()
    base = rss_bytes(os.getpid())
    with RssTrace(os.getpid(), None, interval_s=0.01) as trace:
        t0 = time.perf_counter()
        ckpt.save(1, state, {"step": 1})
        returned_s = time.perf_counter() - t0
        state = jax.block_until_ready(step(state))
        ckpt.wait()
        written_s = time.perf_counter() - t0
    ckpt.close()
    return dict(
        form=form,
        state_gib=state_bytes / GiB,
        inflight_bytes=ckpt.save_inflight_bytes,
        peak_growth_gib=(trace.peak_bytes - base) / GiB,
        returned_s=returned_s,
        written_s=written_s,
    )


def main() -> int:
    parser = common.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="saves per form")
    parser.add_argument("--one", choices=FORMS, help=argparse.SUPPRESS)  # the child's form
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_save(args.one, args.workdir)))
        return 0
    if args.rounds < 1:
        print(f"--rounds={args.rounds}: give at least 1", file=sys.stderr)
        return 2
    common.require_model(MODEL_DIR)
    load = common.warn_if_busy()
    import tempfile

    runs = {form: [] for form in FORMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for form in FORMS if r % 2 == 0 else FORMS[::-1]:
                out = subprocess.run(
                    [sys.executable, __file__, f"--one={form}", f"--workdir={tmp}/{form}{r}"],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                )
                if out.returncode:
                    print(out.stderr[-3000:], file=sys.stderr)
                    return 1
                runs[form].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(runs[form][-1], flush=True)
    rows = []
    for form, got in runs.items():
        row = dict(
            form=form, state_gib=got[0]["state_gib"], inflight_bytes=got[0]["inflight_bytes"]
        )
        for key in ("peak_growth_gib", "returned_s", "written_s"):
            row[key] = statistics.median(g[key] for g in got)
            row[key + "_all"] = [g[key] for g in got]
        rows.append(row)
    common.print_table(rows, ["form", "state_gib", "peak_growth_gib", "returned_s", "written_s"])
    common.write_result(
        "checkpoint_memory",
        dict(
            benchmark="checkpoint_memory",
            config="configs/smollm2_math.py",
            rounds=args.rounds,
            load=load,
            rows=rows,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
