"""Planner vs reality: predict a CPU pipeline run from measured rates, run it, compare.

    python bench/bench_plan_validation.py [--quick] [--devices=1,2,4] [--steps=60]
                                          [--config=configs/default.py]

1. Measure, in this process on one CPU device, for the exact model and shapes of the run:
   - the planner's profile: decode latency per batch (engine_probe: one jitted decode chunk,
     fastest repeat) at every per-device batch H = slots / I the runs use, and the trainer's
     step time on the run's packed [rows, seq_len] batch (fastest repeat);
   - the same work through the host path the pipeline really takes: the Sampler's step() loop
     at H slots, refilled by the pipeline's admission rule (prefill, scheduling, page tables,
     uploads, device_get per chunk, whole-group refills), and build_batch + train step.
2. For each N in --devices, the split the run makes (config devices.sampler, N=1 is the shared
   mode) and four predictions of steady samples/s, sampler/trainer busy and idle, and max lag:
     planner_prelen  the planner (layout.plan_layout, fixed I and H) on the profile, with the
                     lengths the initial policy produced in step 1: the before-the-run answer;
     planner         the same with the run's observed mean length (L̄ drifts as it learns);
     planner_host    the planner's formula on the host-path rates of step 1;
     serial          host-path rates, but generation and training take turns (no overlap).
   N=1 cannot overlap the roles, so every column uses the serial formula there.
3. Run launch.py with those settings (N simulated devices, XLA_FLAGS) in a subprocess and read
   the steady state (second half of the steps) from its metrics.jsonl (plan/validate.py).
4. Print and write the side-by-side table to bench/results/plan_validation[_quick].json with
   the machine load before each phase.

Why the measurement falls short of the planner on this machine (the gaps, in the order the
columns peel them off; the JSON holds the numbers of each):
- Host work per chunk: the profile times a decode chunk alone. The pipeline's Sampler.step()
  also schedules, prefills admitted groups, uploads slot tables and fetches every chunk's
  tokens; for a model this small that costs more than the decode (planner -> planner_host).
- Slot occupancy: the chunk is compiled for all H slots, but slots sit empty until a whole
  group is refilled at a chunk boundary, and sequences that stop mid-chunk idle to its end, so a
  slot-step yields less than one token (part of planner -> planner_host).
- Shared cores: the N "devices" are threads on the same 2 cores (other jobs share them too), so
  sampler and trainer do not run in parallel as the planner assumes, and more simulated devices
  add no compute, only partitioning and dispatch (planner_host -> serial; N=4 vs N=2).
- What remains (serial -> measured): two Python threads contend for the GIL and the cores,
  weight publishing and swaps, reward scoring in the sampler thread, and load: the profile keeps
  the fastest repeat while a run averages over whatever the machine lets it have.
- Weight swaps stall the sampler: params are published as soon as the train step is
  dispatched, so the first decode chunk after a swap waits for that step to finish. The run
  counts the wait as sampler busy time (its swap latency is close to a whole step period), so
  a trainer-bound run looks sampler-bound; generation and training are serialised by this data
  dependency on top of the shared cores. The JSON estimates the stall (swaps/s x (swap latency
  - one chunk)) and the busy time without it.
- Measurement definitions: the run's trainer busy fraction is host time (dispatch is async,
  device compute overlaps its wait), so it understates the trainer's device time; the JSON adds
  trainer_device_busy_est = steps/s x step time. Compile time is excluded from the steady window
  but not from the run's whole-run fractions (reported beside them).
- Lag: the planner's g_max = ceil(H·I·L/(L̄·B)); admission caps the run at max_lag.
- With a 2-device trainer mesh (N=4) the train step apparently returns only when done: its
  host busy time then tracks its device time, weights are ready when published (no stall),
  and the sampler's chunks are slowed by sharing the cores with it instead.
- The planner's own recommendation (planner_recommends in the JSON) inherits the device-only
  profile: decode at batch 1 looks nearly free there, so it proposes tiny H, which the host
  cost per chunk makes slow in practice. For models this small, profile the host path too.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.common import (  # noqa: E402
    at_least,
    load_average,
    number_list,
    print_table,
    quick_alone,
    warn_if_busy,
    write_result,
)

COLUMNS = {
    "planner_prelen": "planner on the device-only profile, lengths of the initial policy",
    "planner": "planner on the device-only profile, the run's observed mean length",
    "planner_host": "planner formula on host-path rates (Sampler.step loop, build_batch + step)",
    "serial": "host-path rates, generation and training taking turns (shared cores, swap stall)",
}


def load_config(path: Path, overrides: dict):
    spec = importlib.util.spec_from_file_location("bench_run_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


# -- step 1: rates -----------------------------------------------------------------------------


def profile_rates(cfg, graphdef, params, sizes, *, context_len, repeats) -> dict:
    """The planner's profile: decode seconds per step at each batch, trainer seconds per step."""
    from pipelinerl_jax.plan import engine_probe

    k = cfg.sampler.chunk_steps
    lat = engine_probe.decode_latency(
        graphdef,
        params,
        sizes,
        context_len=context_len,
        page_size=cfg.sampler.page_size,
        chunk_steps=k,
        repeats=repeats,
    )
    prompt_len = min(cfg.max_prompt_tokens, cfg.batch.seq_len - 1)
    train = engine_probe.train_throughput(
        graphdef,
        params,
        rows=cfg.batch.num_rows,
        seq_len=cfg.batch.seq_len,
        prompt_len=prompt_len,
        repeats=repeats,
        trainer_config=cfg.trainer,
    )
    step_s = cfg.batch.num_rows * cfg.batch.seq_len / train["packed_tokens_per_s"]
    return {
        "decode": {
            "batch_sizes": list(sizes),
            "latency_s": lat,
            "context_len": context_len,
            "chunk_steps": k,
            "statistic": "min",
        },
        "train": {
            "step_s": step_s,
            "rows": cfg.batch.num_rows,
            "seq_len": cfg.batch.seq_len,
            "statistic": "min",
        },
    }


def sampler_loop(cfg, graphdef, params, data, num_slots, *, warmup, chunks) -> dict:
    """The real Sampler on one device at `num_slots` slots, refilled as the pipeline refills it
    (open groups x G < slots + G), timed per step() after `warmup` chunks (compiles)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pipelinerl_jax.data.datasets import PromptStream
    from pipelinerl_jax.sampler.sampler import PagedSampler
    from pipelinerl_jax.sampler.sequence import SamplingParams

    tokenizer, source, encode = data
    g = cfg.group_size
    mesh = Mesh(np.asarray(jax.devices()[:1]), (cfg.sampler.data_axis,))
    scfg = dataclasses.replace(cfg.sampler, num_slots=num_slots, seed=cfg.sampler.seed + cfg.seed)
    sampler = PagedSampler(
        graphdef,
        params,
        scfg,
        mesh=mesh,
        eos_token_ids=tuple(getattr(tokenizer, "eos_token_ids", ())),
    )
    sampling = SamplingParams(
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
    )
    stream = PromptStream(source, seed=cfg.data.shuffle_seed + cfg.seed)
    open_groups, done, times, tokens = {}, [], [], []
    for i in range(warmup + chunks):
        while len(open_groups) * g < num_slots + g:
            rid = sampler.submit(encode(next(stream)), n=g, params=sampling)
            open_groups[rid] = g
        before = sampler.stats["decode_tokens"]
        t0 = time.perf_counter()
        finished = sampler.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(sampler.stats["decode_tokens"] - before)
        for s in finished:
            done.append(s)
            open_groups[s.request_id] -= 1
            if not open_groups[s.request_id]:
                del open_groups[s.request_id]
    k = cfg.sampler.chunk_steps
    return {
        "num_slots": num_slots,
        "chunks": chunks,
        "chunk_s_mean": statistics.mean(times),
        "chunk_s_median": statistics.median(times),
        "tokens_per_s": sum(tokens) / sum(times),
        "occupancy": sum(tokens) / (len(tokens) * num_slots * k),
        "lengths": [len(s.token_ids) for s in done],
        "samples": done,
    }


def build_batch_s(cfg, samples, repeats: int = 5) -> float:
    """Host seconds to pack one step's batch from real samples (median)."""
    import numpy as np

    from pipelinerl_jax.rl.batch import ScoredSample, build_batch

    by_group = {}
    for s in samples:
        by_group.setdefault(s.request_id, []).append(s)
    full = [grp for grp in by_group.values() if len(grp) == cfg.group_size]
    rng = np.random.default_rng(0)
    batch = [
        ScoredSample(
            prompt_tokens=s.prompt_ids,
            completion_tokens=s.token_ids,
            completion_logprobs=s.logprobs,
            completion_versions=s.versions,
            reward=float(rng.uniform()),
            group_id=s.request_id,
            finished=s.finish_reason == "stop",
        )
        for grp in full[: cfg.groups_per_step]
        for s in grp
    ]
    if len(batch) < cfg.batch_size:
        raise SystemExit(f"sampler loop finished only {len(full)} whole groups; raise --chunks")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build_batch(batch, cfg.batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- step 3: the run -----------------------------------------------------------------------------


def run_pipeline(config_path: Path, overrides: dict, devices: int, workdir: Path) -> list[dict]:
    flags = [
        f"--config={config_path}",
        f"--workdir={workdir}",
        *(f"--config.{k}={v}" for k, v in overrides.items()),
    ]
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"run on {devices} devices failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# -- steps 2 and 4 -------------------------------------------------------------------------------


def predictions(shape, prof_curve, prof, loops, build_s, prior, observed):
    """The four prediction columns for one run (see the module docstring)."""
    from pipelinerl_jax.plan import validate

    h = shape.gen_batch
    device = dict(
        gen_tokens_per_s_per_device=float(prof_curve.rate(h)),
        train_step_s_per_device=prof["train"]["step_s"],
    )
    host_step = prof["train"]["step_s"] + build_s
    return {
        "planner_prelen": validate.predict(shape, **device, lengths=prior),
        "planner": validate.predict(shape, **device, lengths=observed),
        "planner_host": validate.predict(
            shape,
            gen_tokens_per_s_per_device=loops[h]["tokens_per_s"],
            train_step_s_per_device=host_step,
            lengths=observed,
        ),
        "serial": validate.serial_prediction(
            shape,
            gen_tokens_per_s=loops[shape.num_slots]["tokens_per_s"],
            train_step_s=host_step,
            lengths=observed,
        ),
    }


def explain(shape, meas, curve, loops, k) -> dict:
    """The gap's parts in numbers. The run does not log its chunk count, so the in-run chunk
    time is estimated from tokens generated per second and the lone loop's tokens per chunk."""
    from pipelinerl_jax.plan import validate

    loop = loops[shape.num_slots]
    tokens_per_chunk = loop["occupancy"] * shape.num_slots * k
    chunks_per_s = meas["samples_per_s"] * meas["mean_len"] / tokens_per_chunk
    lone = loops[shape.gen_batch]
    stall = validate.swap_stall_fraction(
        steps_per_s=meas["steps_per_s"],
        swaps_per_step=meas["swaps_per_step"],
        swap_latency_s=meas["swap_latency_s_median"],
        chunk_s=lone["chunk_s_mean"],
    )
    return {
        "device_chunk_s": k * float(curve.step_time(shape.gen_batch)),
        "loop_chunk_s": lone["chunk_s_mean"],
        "host_overhead_factor": lone["chunk_s_mean"]
        / (k * float(curve.step_time(shape.gen_batch))),
        "occupancy": lone["occupancy"],
        "in_run_chunk_s_est": meas["sampler_busy"] / chunks_per_s,
        "compile_and_first_step_s": meas["first_step_time_s"],
        "trainer_device_busy_est": meas["trainer_device_busy_est"],
        "sampler_swap_stall_est": stall,
        "sampler_busy_excl_stall_est": meas["sampler_busy"] - stall,
    }


def recommendation(shape, prof_curve, prof, observed) -> dict | None:
    """What the planner would choose for this N, B and lag bound (free I and H)."""
    from pipelinerl_jax.plan import layout
    from pipelinerl_jax.plan.utilisation import PlanError

    if shape.shared:
        return None
    tau = prof["train"]["step_s"] / (shape.batch_size * observed.mean_len)
    dprof = layout.DeviceProfile(prof_curve, tau)
    try:
        plan = layout.plan_layout(
            dprof,
            layout.Workload(shape.devices, shape.batch_size, observed, shape.max_lag),
            compare_conventional=False,
        )
    except PlanError as e:
        return {"error": str(e)}
    return {
        "gen_devices": plan.gen_devices,
        "gen_batch": plan.gen_batch,
        "lag": plan.lag,
        "samples_per_s": plan.samples_rate,
        "gen_idle": plan.gen_idle,
        "train_idle": plan.train_idle,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.py"))
    parser.add_argument("--devices", default="1,2,4", help="simulated CPU device counts N")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per probe")
    parser.add_argument("--chunks", type=int, default=120, help="timed sampler-loop chunks")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="N=2 only, 12 steps, short probes: checks the script in minutes",
    )
    args = parser.parse_args()
    quick_alone(args, parser, ("devices", "steps", "repeats", "chunks"))
    if args.quick:
        args.devices, args.steps, args.repeats, args.chunks = "2", 12, 3, 40
    device_counts = number_list(args.devices, "--devices", minimum=1, example="1,2,4")
    for flag in ("steps", "repeats", "chunks"):
        at_least(getattr(args, flag), f"--{flag}")
    config_path = Path(args.config).resolve()
    overrides = {
        "steps": args.steps,
        "seed": args.seed,
        "log_every": 0,
        "checkpoint_every": 0,
        "eval_every": 0,
    }
    load = {"start": warn_if_busy()}

    import jax
    import numpy as np

    from pipelinerl_jax.pipeline import components as build_lib
    from pipelinerl_jax.pipeline import config_dict
    from pipelinerl_jax.plan import model, validate
    from pipelinerl_jax.plan.utilisation import UtilisationCurve

    cfg = config_dict.from_config_dict(load_config(config_path, overrides))
    shapes = {}
    for n in device_counts:
        sampler_devs, _ = build_lib.split_devices(list(range(n)), cfg.devices)
        shapes[n] = validate.RunShape(
            devices=n,
            gen_devices=len(sampler_devs),
            num_slots=cfg.sampler.num_slots,
            batch_size=cfg.batch_size,
            max_lag=cfg.max_lag,
            max_new_tokens=cfg.max_new_tokens,
        )
    gen_batches = sorted({s.gen_batch for s in shapes.values()} | {cfg.sampler.num_slots})
    sizes = gen_batches if args.quick else sorted(set(gen_batches) | {1, 4, 16})

    # Step 1: rates, on one device, for the run's model (same init as the run).
    data = build_lib.build_data(cfg)
    graphdef, params = build_lib.build_model(cfg, data[0], jax.random.key(cfg.seed))
    stream_probe = iter(data[1])
    prompt_mean = float(np.mean([len(data[2](next(stream_probe))) for _ in range(64)]))
    context = int(round(prompt_mean + cfg.max_new_tokens / 2))
    t0 = time.perf_counter()
    prof = profile_rates(cfg, graphdef, params, sizes, context_len=context, repeats=args.repeats)
    load["after_profile"] = load_average()
    loops = {
        h: sampler_loop(
            cfg, graphdef, params, data, h, warmup=max(20, args.chunks // 4), chunks=args.chunks
        )
        for h in gen_batches
    }
    build_s = build_batch_s(cfg, loops[cfg.sampler.num_slots]["samples"])
    probe_s = time.perf_counter() - t0
    curve = UtilisationCurve.from_decode_latency(
        prof["decode"]["batch_sizes"], prof["decode"]["latency_s"], source="decode"
    )
    prior = model.LengthDistribution.from_lengths(
        [min(x, cfg.max_new_tokens) for x in loops[cfg.sampler.num_slots]["lengths"]]
    )
    k = cfg.sampler.chunk_steps
    print(
        f"profile ({probe_s:.0f}s incl. compiles): decode "
        + ", ".join(
            f"H={b}: {s * 1e3:.2f} ms/step" for b, s in zip(sizes, prof["decode"]["latency_s"])
        )
        + f"; train step {prof['train']['step_s'] * 1e3:.1f} ms, batch build "
        f"{build_s * 1e3:.1f} ms"
    )
    for h, lp in loops.items():
        print(
            f"sampler loop H={h}: {lp['chunk_s_mean'] * 1e3:.1f} ms/chunk vs "
            f"{k * float(curve.step_time(h)) * 1e3:.1f} ms device-only; occupancy "
            f"{lp['occupancy']:.2f} tokens/slot-step; {lp['tokens_per_s']:.0f} tokens/s"
        )

    # Steps 2-4 per device count.
    runs, table = [], []
    for n, shape in shapes.items():
        load_before = load_average()
        with tempfile.TemporaryDirectory() as tmp:
            t_run = time.perf_counter()
            records = run_pipeline(config_path, overrides, n, Path(tmp) / "run")
            run_s = time.perf_counter() - t_run
        meas = validate.steady_measurement(records)
        observed = validate.maxent_lengths(
            min(meas["mean_len"], cfg.max_new_tokens), cfg.max_new_tokens
        )
        preds = predictions(shape, curve, prof, loops, build_s, prior, observed)
        meas["trainer_device_busy_est"] = meas["steps_per_s"] * prof["train"]["step_s"]
        gaps = explain(shape, meas, curve, loops, k)
        label = (
            f"N={n} ({'shared' if shape.shared else f'{shape.gen_devices}+{shape.train_devices}'})"
        )
        table.extend(validate.comparison_rows(preds, meas, label=label, reference="planner"))
        runs.append(
            {
                "devices": n,
                "split": dataclasses.asdict(shape),
                "label": label,
                "process_s": run_s,
                "load_before": load_before,
                "measured": meas,
                "predictions": preds,
                "gaps": gaps,
                "prior_mean_len": prior.mean_len,
                "planner_recommends": recommendation(shape, curve, prof, observed),
            }
        )
        print(
            f"{label}: measured {meas['samples_per_s']:.1f} samples/s, planner "
            f"{preds['planner']['samples_per_s']:.1f}, serial {preds['serial']['samples_per_s']:.1f}"
            f" (mean length {meas['mean_len']:.2f}, run {run_s:.0f}s); a decode chunk took "
            f"~{gaps['in_run_chunk_s_est'] * 1e3:.0f} ms in the run vs "
            f"{gaps['loop_chunk_s'] * 1e3:.0f} ms in the lone sampler loop and "
            f"{gaps['device_chunk_s'] * 1e3:.0f} ms device-only; sampler busy "
            f"{meas['sampler_busy']:.2f} of which ~{gaps['sampler_swap_stall_est']:.2f} waiting "
            f"for new weights; trainer device busy ~{gaps['trainer_device_busy_est']:.2f}"
        )
    load["end"] = load_average()
    print_table(table, ["run", "quantity", *COLUMNS, "measured", "measured/planner"])
    for lp in loops.values():
        del lp["samples"]
    write_result(
        "plan_validation" + ("_quick" if args.quick else ""),
        {
            "config": {
                **vars(args),
                "config_file": str(config_path.relative_to(ROOT))
                if config_path.is_relative_to(ROOT)
                else str(config_path),
            },
            "load": load,
            "cpus": os.cpu_count(),
            "profile": prof,
            "sampler_loops": loops,
            "batch_build_s": build_s,
            "prior_lengths_mean": prior.mean_len,
            "runs": runs,
            "table": table,
            "columns": COLUMNS,
        },
    )


if __name__ == "__main__":
    main()
