"""Renders the tables of measured figures from bench/results/*.json.

    python bench/report.py            # print the tables
    python bench/report.py --write    # also rewrite them between their markers:
                                      #   README.md: the peer ratios, the headline table
                                      #     and the GPU summary
                                      #   docs/benchmarks.md: the peer ratios (bench/
                                      #     peer_table.py) and every measured figure
                                      #   docs/gpu.md: the GPU summary
                                      #   docs/gpu_compile.md: every compiled GPU program

Only full (non --quick) results are used; a benchmark with no result yet gets a row saying so,
never a number. Each row names the command that produced it and the machine load it ran under.
The README's headline rows are rendered by the same functions as the full table, so the two
never disagree. Files are written all or nothing: if one lacks its markers, none is written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.common, when run as `python bench/report.py`

from bench import peer_table  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- bench/report.py: begin -->", "<!-- bench/report.py: end -->"
GPU_BEGIN, GPU_END = "<!-- bench/report.py gpu: begin -->", "<!-- bench/report.py gpu: end -->"
HEADLINE_BEGIN = "<!-- bench/report.py headline: begin -->"
HEADLINE_END = "<!-- bench/report.py headline: end -->"
PEERS_BEGIN = "<!-- bench/report.py peers: begin -->"
PEERS_END = "<!-- bench/report.py peers: end -->"
GiB = 2**30


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _other_machines(name: str, newest: dict) -> list[dict]:
    """The newest result of `name` from each other machine kind (bench/results/by_machine),
    so a figure measured on both kinds of machine shows both."""
    from bench.common import machine_kind

    shown = machine_kind(newest.get("cpu") or {})
    out = []
    for path in sorted((RESULTS / "by_machine").glob(f"{name}.*.json")):
        kind = path.name[len(name) + 1 : -len(".json")]
        if kind != shown and "." not in kind:
            out.append(json.loads(path.read_text()))
    return out


def _load_avg(d: dict) -> str:
    load = d.get("load") or d.get("load_before") or {}
    load = load.get("start", load)  # plan_validation records the load per phase
    return f"{load['loadavg_1m']:.1f}" if "loadavg_1m" in load else "?"


def _machine(d: dict) -> str:
    """Short CPU label and date: figures from different machines do not compare (the same
    code ran 1.3-2x apart on the 2-core AMD EPYC and the 2-core Xeon with AMX)."""
    date = str(d.get("date", "?"))[:10]
    cpu = d.get("cpu")
    if not isinstance(cpu, dict):
        return f"cpu not recorded, {date}"
    units = (
        "AMX"
        if cpu.get("amx_bf16")
        else "AVX-512"
        if cpu.get("avx512f")
        else "AVX2"
        if cpu.get("avx2")
        else "no AVX2"
    )
    model = str(cpu.get("model", "?")).replace("(R)", "").replace(" Processor", "")
    return f"{model} ({units}), {date}"


def _forward(d):
    rows = {(r["impl"], r["dtype"]): r for r in d["rows"]}
    out = []
    for dtype in ("float32", "bfloat16"):
        ours, theirs = rows.get(("pipelinerl_jax", dtype)), rows.get(("transformers", dtype))
        if ours and theirs:
            out.append(
                (
                    f"forward {dtype}, 8 x 512 tokens: tokens/s",
                    f"{ours['tokens_per_s']:.0f} ({ours['frac_f32_peak']:.0%} of f32 matmul peak)",
                    f"{theirs['tokens_per_s']:.0f}",
                    f"{theirs['median_s'] / ours['median_s']:.2f}x",
                )
            )
    return out


def _decode(d):
    out = []
    for r in d["rows"]:
        peak = r.get("frac_f32_matmul_peak")
        extra = f" ({peak:.0%} of f32 peak)" if peak is not None else ""
        how = f", temperature {r['temperature']:g}" if r.get("temperature") else ""
        out.append(
            (
                f"decode {r['dtype']}, batch {r['batch']}{how}: tokens/s",
                f"{r['ours_tok_s']:.0f}{extra}",
                f"{r['hf_tok_s']:.0f}",
                f"{r['ratio']:.2f}x",
            )
        )
    swap = d.get("param_swap")
    if swap:
        out.append(
            (
                f"param swap at a chunk boundary, batch {swap['batch']}: extra cost",
                f"{swap['extra_cost_in_decode_steps']:.2f} decode steps "
                f"(recompiled: {swap['recompiled']})",
                "-",
                "-",
            )
        )
    return out


def _decode_real(d):
    """SmolLM2 decode rows, each against its goal (>= 2.5x f32, >= 1.5x bf16)."""
    c = d["config"]
    out = []
    for r in d["rows"]:
        how = "greedy" if not r.get("temperature") else f"temperature {r['temperature']:g}"
        if r.get("head_dtype", "float32") != r["dtype"]:
            how += f", {r.get('head_dtype', 'float32')} head"
        notes = []
        if r.get("ours_frac_f32_matmul_peak") is not None:
            notes.append(f"{r['ours_frac_f32_matmul_peak']:.0%} of f32 peak")
        if r.get("same_tokens_frac") is not None:
            notes.append(f"{r['same_tokens_frac']:.0%} same tokens")
        ours = f"{r['ours_tok_s']:.0f}" + (f" ({'; '.join(notes)})" if notes else "")
        goal = r.get("goal")
        met = "" if goal is None else (" (goal met)" if r["ratio"] >= goal else f" (goal {goal}x)")
        out.append(
            (
                f"SmolLM2-135M decode {r['dtype']}, batch {r['batch']}, {how}, {c['prompt_len']} + "
                f"{c['new_tokens']} tokens: tokens/s",
                ours,
                f"{r['hf_tok_s']:.0f}",
                f"{r['ratio']:.2f}x{met}",
            )
        )
    return out


def _decode_real_range(d):
    """The headline view of decode_real: one row per dtype, the range over every batch size
    and both greedy and temperature-1 sampling (each row of the full table lies inside)."""
    c = d["config"]
    out = []
    for dtype in ("float32", "bfloat16"):
        rows = [r for r in d["rows"] if r["dtype"] == dtype]
        if not rows:
            continue
        span = lambda key, fmt: (
            f"{min(r[key] for r in rows):{fmt}}-{max(r[key] for r in rows):{fmt}}"
        )
        batches = sorted({r["batch"] for r in rows})
        goals = {r["goal"] for r in rows if r.get("goal") is not None}
        met = sum(1 for r in rows if r.get("goal") is not None and r["ratio"] >= r["goal"])
        goal = f" (goal {max(goals):g}x: met in {met} of {len(rows)})" if goals else ""
        out.append(
            (
                f"SmolLM2-135M decode {dtype}, batch {'/'.join(map(str, batches))}, greedy "
                f"and temperature 1, {c['prompt_len']} + {c['new_tokens']} tokens: tokens/s",
                span("ours_tok_s", ".0f"),
                span("hf_tok_s", ".0f"),
                f"{span('ratio', '.2f')}x{goal}",
            )
        )
    return out


def _projections(d):
    out = []
    for r in d["rows"]:
        out.append(
            (
                f"decode layer stack without attention, f32, N = {r['tokens']}: us per layer",
                f"{r['ours_us_per_layer']:.0f} ({r['ours_weight_gb_s']:.1f} GB/s of weights)",
                f"{r['torch_us_per_layer']:.0f}",
                f"{r['ratio']:.2f}x",
            )
        )
    ceiling = d.get("gemv_ceiling_gb_s")
    if ceiling:
        out.append(
            (
                "one 166 MB f32 matrix-vector product: GB/s (the read-rate ceiling)",
                f"{ceiling['xla']:.1f}",
                f"{ceiling['torch']:.1f}",
                f"{ceiling['xla'] / ceiling['torch']:.2f}x",
            )
        )
    return out


def _matvec_forms(d):
    """Each way of writing batch 1's products, against torch's F.linear in the same dtype."""
    torch = {r["dtype"]: r for r in d["rows"] if r["form"].startswith("torch_")}
    out = []
    for r in d["rows"]:
        if r["form"].startswith("torch_"):
            continue
        peer = torch[r["dtype"]]
        weights = "f32 weights" if r["dtype"] == "float32" else "bf16 weights"
        out.append(
            (
                f"one decode token's matmuls, SmolLM2-135M shapes, batch 1, {weights}, form "
                f"`{r['form']}`: ms (weight read rate)",
                f"{r['ms_per_token']:.1f} ({r['weight_gb_s']:.1f} GB/s)",
                f"{peer['ms_per_token']:.1f} ({peer['weight_gb_s']:.1f} GB/s)",
                f"{peer['ms_per_token'] / r['ms_per_token']:.2f}x",
            )
        )
    return out


_GEMM_FORMS = {
    "contract": "token axis contracted in place",
    "copy": "activations copied transposed, copy timed",
    "copy_values": "activations copied transposed as values, not bits, copy timed",
}


def _gemm(d):
    def form(r):
        if "form" not in r:
            return ""
        step = ", the step's form" if r["step_form"] else ""
        return f" ({_GEMM_FORMS[r['form']]}{step})"

    return [
        (
            f"train-step matmul alone, {r['dtype']}, {r['shape']}{form(r)}, M x K x N = "
            f"{r['m']} x {r['k']} x {r['n']}: GFLOP/s",
            f"{r['ours_gflops']:.0f}",
            f"{r['torch_gflops']:.0f}",
            f"{r['ratio']:.2f}x",
        )
        for r in d["rows"]
    ]


def _train(d):
    out = []
    for r in d["rows"]:
        timed = "torch_tok_s" in r
        out.append(
            (
                f"train step {r['dtype']}, {d['config']['sequences']} x "
                f"{d['config']['seq_len']}: tokens/s",
                f"{r['ours_tok_s']:.0f}",
                f"{r['torch_tok_s']:.0f}" if timed else "not timed (too slow here)",
                f"{r['ratio']:.2f}x" if timed else "-",
            )
        )
    return out


def _pipeline(d):
    rows = {r["mode"]: r for r in d["rows"]}
    p, c = rows.get("pipeline"), rows.get("conventional")
    if not (p and c):
        return []
    where = f"{d['config']['devices']} simulated devices, max lag {d['config']['lag']}"
    return [
        (
            f"RL samples/s, {where}",
            f"{p['samples_per_s']:.1f} (pipeline)",
            f"{c['samples_per_s']:.1f} (conventional)",
            f"{p['samples_per_s'] / c['samples_per_s']:.2f}x",
        ),
        (
            f"sampler / trainer busy fraction, {where}",
            f"{p['sampler_busy']:.2f} / {p['trainer_busy']:.2f}",
            f"{c['sampler_busy']:.2f} / {c['trainer_busy']:.2f}",
            "-",
        ),
        (
            f"sampler pause per weight swap, {where}",
            f"{p['swap_pause_ms']:.2f} ms",
            f"{c['swap_pause_ms']:.2f} ms",
            "-",
        ),
        (
            f"sequences holding tokens of 2+ policy versions, {where}",
            f"{p['mixed_seq_frac']:.0%}",
            f"{c['mixed_seq_frac']:.0%}",
            "-",
        ),
    ]


def _demo(d):
    gains = [r["gain"] for r in d["rows"]]
    walls = [r["process_wall_s"] for r in d["rows"]]
    sets = [str(o) for o in d.get("overrides") or ()]
    return [
        (
            f"demo learns{' with ' + ', '.join(sets) if sets else ''}: reward gain (last tenth "
            f"- first 20 steps), {len(gains)} seeds",
            f"min {min(gains):.2f}, max {max(gains):.2f}; {max(walls):.0f} s per run at most",
            ">= 0.4 (criterion)",
            "pass" if d["passed"] else "FAIL",
        )
    ]


def _guess_seeds(d):
    rows = d["rows"]
    evals = [(r["eval_first"], r["eval_last"]) for r in rows]
    walls = [r["process_wall_s"] for r in rows]
    turns = [r["eval_turns"] for r in rows if r.get("eval_turns") is not None]
    return [
        (
            f"multi-turn toy (configs/guess.py, find 0-15 in <= 6 turns from '<'/'>'): held-out "
            f"greedy success before -> after, {len(rows)} seeds",
            "; ".join(f"{a:.2f} -> {b:.2f}" for a, b in evals)
            + f"; {min(turns):.1f}-{max(turns):.1f} turns; {max(walls) / 60:.1f} min per run at most",
            d["criterion"].replace(" for every seed", ""),
            "pass" if d["passed"] else "FAIL",
        )
    ]


def _real_calculator(d):
    task = "numbers to 1000" if "max_value" in " ".join(d.get("overrides", [])) else "numbers to 10"
    return [
        (
            "SmolLM2-135M with a calculator (configs/smollm2_calculator.py, equations environment, "
            f"one-operation word problems, {task}, {d['steps']} steps, "
            f"{(d.get('wall_s') or d['process_wall_s']) / 60:.0f} min): "
            "held-out greedy accuracy and calculator calls per episode, before -> after",
            f"{d['accuracy_before']:.2f} -> {d['accuracy_after']:.2f}; calls "
            f"{d['calls_before']:.2f} -> {d['calls_after']:.2f}",
            "the starting model",
            f"{d['accuracy_after'] - d['accuracy_before']:+.2f} accuracy",
        )
    ]


def _episodes(d):
    pipe, conv = d["rows"]
    latency = f", {d['latency_s']:g} s per environment turn" if d.get("latency_s") else ""
    return [
        (
            f"multi-turn episodes (configs/guess.py, {pipe['steps']} steps{latency}): pipeline "
            "vs conventional mode, samples/s and reward per sample (last tenth)",
            f"{pipe['samples_per_s']:.0f}/s, {pipe['reward_last_tenth']:.2f}; episodes span "
            f"<= {pipe['version_span_max']} versions",
            f"{conv['samples_per_s']:.0f}/s, {conv['reward_last_tenth']:.2f}",
            f"{d['ratio_samples_per_s']:.2f}x",
        )
    ]


def _plan(d):
    out = []
    for r in d["table"]:
        if r["quantity"] == "samples_per_s":
            out.append(
                (
                    f"planner vs real run, {r['run']}: samples/s",
                    f"{r['measured']:.0f} measured",
                    f"{r['planner']:.0f} predicted",
                    f"{r['measured/planner']:.2f}",
                )
            )
    return out


REAL = "SmolLM2-135M, configs/smollm2_math.py"


def _real_profile(d):
    p, solo = d["pipeline"], d["alone"]
    cache = "warm" if d.get("warm_cache") else "cold"
    steps = p["per_step_seconds"]
    where = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in steps.items())
    serial_tok_s = p["steady_generated_tokens_per_step"] / d["serial_s_per_step"]
    rows = [
        (
            f"{REAL}: peak RSS of a whole run, f32, 16 x 288 tokens a step",
            f"{p['peak_rss_gib']:.2f} GiB",
            "<= 3.73 GiB (4 GB goal)",
            "meets" if p["peak_rss_gib"] * 2**30 <= 4e9 else "misses",
        ),
        (
            f"{REAL}: launch to first step, {cache} compilation cache",
            f"{p['seconds_to_first_step']:.0f} s ({sum(p['compile_seconds_by_step'][:2]):.0f} s "
            f"compiling)",
            "-",
            "-",
        ),
        (
            f"{REAL}: compilations after warm-up (steps 2-{len(p['compiles_by_step']) - 1})",
            f"{p['compiles_after_warmup']}",
            "0 (goal)",
            "meets" if p["compiles_after_warmup"] == 0 else "misses",
        ),
        (
            f"{REAL}: generated tokens/s, pipeline (one shared device) vs serial prediction "
            "(sampler alone + train step alone)",
            f"{p['pipeline_tokens_per_s']:.1f} ({p['steady_s_per_step']:.0f} s a step)",
            f"{serial_tok_s:.1f} ({d['serial_s_per_step']:.0f} s: sampler "
            f"{solo['sampler_tokens_per_s']:.0f} tok/s, train {solo['train_step_s']:.0f} s)",
            f"{d['pipeline_over_serial']:.2f}x (goal >= {d['goal_pipeline_over_serial']})",
        ),
        (
            f"{REAL}: where a steady step's seconds go (idle decode slots "
            f"{p['idle_slot_fraction']:.0%})",
            where
            + (
                f"; rewards {solo['reward_s_per_step']:.2f} of CPU in worker processes"
                if "reward_s_per_step" in solo
                else ""
            ),
            "-",
            "-",
        ),
    ]
    if "planner" in d:
        shared, split = d["planner"]["shared_1_device"], d["planner"]["split_2_devices"]
        rows.append(
            (
                f"{REAL}: generated tokens/s, measured (one shared device) vs the planner's "
                "prediction from the lone rates: shared device (= serial) / 1 sampler + 1 "
                "trainer device",
                f"{p['pipeline_tokens_per_s']:.1f} measured",
                f"{shared['tokens_per_s']:.1f} / {split['tokens_per_s']:.1f} predicted "
                f"({split['bottleneck']}-bound on 2 devices)",
                f"{p['pipeline_tokens_per_s'] / shared['tokens_per_s']:.2f}",
            )
        )
    return rows


def _real_learning(d):
    runs = d["runs"]
    goals = d["goals"]
    acc = [(r["accuracy_before"], r["accuracy_after"]) for r in runs]
    box = [(r["boxed_before"], r["boxed_after"]) for r in runs]
    fmt = lambda pairs: "; ".join(f"{a:.2f} -> {b:.2f}" for a, b in pairs)
    steps = "/".join(str(r["steps"]) for r in runs)
    wall = max(r.get("wall_s", r["train"][-1]["time"]) for r in runs) / 60
    gains = [b - a for a, b in acc]
    rows = [
        (
            f"{REAL}: held-out greedy accuracy before -> after {steps} steps, one worked example "
            f"in the prompt, {len(runs)} seed(s), {wall:.0f} min per run at most (launch to exit)",
            fmt(acc),
            f"+{goals['accuracy']:.2f} (goal)",
            f"{min(gains):+.2f} .. {max(gains):+.2f}",
        ),
        (
            f"{REAL}: held-out boxed-answer rate before -> after, one worked example",
            fmt(box),
            f"+{goals['boxed']:.2f} (goal)",
            f"{min(b - a for a, b in box):+.2f} .. {max(b - a for a, b in box):+.2f}",
        ),
    ]
    start = d.get("zero_shot_start")
    after = [r["zero_shot_after"] for r in runs if "zero_shot_after" in r]
    if start and after:
        for key, label, goal in (
            ("accuracy", "accuracy", "accuracy"),
            ("boxed", "boxed rate", "boxed"),
        ):
            pairs = [(start[key], z[key]) for z in after]
            rows.append(
                (
                    f"{REAL}: zero-shot (the paper's prompt alone) held-out {label}, "
                    "starting model -> each seed's final policy",
                    fmt(pairs),
                    f"+{goals[goal]:.2f} (goal)",
                    f"{min(b - a for a, b in pairs):+.2f} .. {max(b - a for a, b in pairs):+.2f}",
                )
            )
    return rows


def _real_learning_vs_full(what: str):
    """A variant's run (`what`: "with LoRA", ...) against the full fine-tune's gain
    (real_learning.json, f32 sampler), with its memory."""
    return lambda d: _real_learning_variant(d, what)


def _real_learning_variant(d, what: str):
    full = _load("real_learning")
    full_gains = [r["accuracy_gain"] for r in full["runs"]] if full else []
    peer = (
        f"full fine-tune {min(full_gains):+.2f} .. {max(full_gains):+.2f} "
        f"(mean {statistics.mean(full_gains):+.2f})"
        if full_gains
        else "full fine-tune: not measured"
    )
    rows = []
    overrides = " ".join(d.get("overrides", []))
    for r in d["runs"]:
        wall = r.get("wall_s", r["train"][-1]["time"]) / 60
        rows.append(
            (
                f"{REAL} {what}{f' ({overrides})' if overrides else ''}: held-out greedy "
                f"accuracy before -> after {r['steps']} steps, {wall:.0f} min (launch to exit)",
                f"{r['accuracy_before']:.2f} -> {r['accuracy_after']:.2f} "
                f"({r['accuracy_gain']:+.2f})",
                peer,
                f"{r['accuracy_gain'] / statistics.mean(full_gains):.2f}x the mean gain"
                if full_gains
                else "-",
            )
        )
        if "peak_rss_gib" in r:
            estimate = r.get("memory_estimate_gib")
            rows.append(
                (
                    f"{REAL} {what}: peak RSS of the whole run, evaluations included, "
                    "against the start-up estimate",
                    f"{r['peak_rss_gib']:.2f} GiB",
                    f"estimate {estimate:.1f} GiB" if estimate else "-",
                    f"{estimate / r['peak_rss_gib']:.2f}x" if estimate else "-",
                )
            )
    return rows


def _filtering(d):
    """Dynamic sampling against none: training-reward gain per 1k samples and per minute."""
    f, u = d["filtered"], d["unfiltered"]
    cfg = d.get("config", "configs/default.py").rsplit("/", 1)[-1]

    def cell(r):
        return (
            f"{r['reward_first_third']:.3f} -> {r['reward_last_third']:.3f} over {r['steps']} "
            f"steps; {1e3 * r['reward_gain'] / r['samples_generated']:+.4f} per 1k samples, "
            f"{r['gain_per_min']:+.3f}/min; {r['samples_generated']} samples, "
            f"{r['wall_s'] / 60:.1f} min"
        )

    ratio = d["filtered_over_unfiltered"]
    per_sample, per_min = ratio.get("gain_per_1k_samples"), ratio.get("gain_per_min")
    return [
        (
            f"dynamic sampling ({cfg}, batch.filter_groups): reward of every generated group, first -> last "
            f"third, gain per sample and per minute; {f['groups_dropped']} groups dropped, "
            f"{f['groups_forced']} forced",
            cell(f),
            cell(u) + " (unfiltered)",
            (f"{per_sample:.2f}x per sample" if per_sample is not None else "-")
            + (f", {per_min:.2f}x per minute" if per_min is not None else ""),
        )
    ]


def _deterministic(d):
    """Deterministic pipeline mode against the default: trained samples/s, with and without
    checkpoints (a deterministic run drains before each)."""
    rows = []
    v = d["variants"]
    for key, r in v.items():
        if key.startswith("default"):
            continue
        ckpt = key.endswith("_ckpt")
        base = v["default_ckpt" if ckpt else "default"]
        k = key.removesuffix("_ckpt").removeprefix("deterministic").lstrip("_") or "derived"
        replay = {True: "replayed identically", False: "runs DIFFERED", None: "-"}
        rows.append(
            (
                f"deterministic pipeline mode (swap_chunks {k}"
                + (", drained checkpoints" if ckpt else "")
                + f"): trained samples/s, median of {len(r['runs'])}; "
                f"{replay[r['replayed_identically']]}; reward (last fifth) "
                f"{r['reward_last_fifth_median']:.3f} vs {base['reward_last_fifth_median']:.3f}",
                f"{r['trained_samples_per_s_median']:.0f}/s, lag {r['lag_token_mean']:.2f}, "
                f"{r['mixed_version_frac']:.0%} of sequences span a swap",
                f"{base['trained_samples_per_s_median']:.0f}/s, lag {base['lag_token_mean']:.2f}"
                f", {base['mixed_version_frac']:.0%} (default)",
                f"{r['over_default']:.2f}x",
            )
        )
    return rows


def _elastic(d):
    """Elastic samplers: trained samples/s before, during and after losing a sampler."""
    r = d["trained_samples_per_s"]
    fmt = lambda v: "-" if v is None else f"{v:.0f}/s"  # noqa: E731
    during = r["during"] / r["before"] if r["during"] and r["before"] else None
    after = r["after"] / r["before"] if r["after"] and r["before"] else None
    return [
        (
            f"--elastic, 1 trainer + 2 samplers: sampler 1 killed -9 at step {d['steps']['kill']}, "
            f"dropped {d['kill_to_drop_s']:.0f} s later, its command run again joined in "
            f"{d['restart_to_join_s']:.0f} s; trained samples/s during (1 sampler) and after; "
            f"every prompt once: {d['every_prompt_once']}, max lag {d['max_lag']} "
            f"(bound {d['lag_bound']})",
            f"during {fmt(r['during'])}, after {fmt(r['after'])}",
            f"before {fmt(r['before'])}",
            (f"{during:.2f}x during" if during else "-")
            + (f", {after:.2f}x after" if after else ""),
        )
    ]


def _lora_decode(d):
    merged, unmerged = d["rows"][0], d["rows"][1]
    return [
        (
            "LoRA sampler, SmolLM2-135M shapes f32, rank 16 on all projections, 16 slots: "
            "decode tok/s and swap (prepare) ms, adapters unmerged vs merged weights",
            f"{unmerged['decode_tok_s']:.0f} tok/s, swap {unmerged['swap_prepare_ms']:.0f} ms",
            f"{merged['decode_tok_s']:.0f} tok/s, swap >= {merged['swap_prepare_ms']:.0f} ms "
            "(merged)",
            f"{d['decode_ratio_unmerged_over_merged']:.2f}x decode; picked: {d['pick']}",
        )
    ]


def _decode_widths(d):
    full, narrow = d["every_slot"], d["narrowed"]
    ms = d["step_ms_by_width"]
    return [
        (
            f"{REAL}: the sampler alone ({d['dtype']}, 4 x 4 attempts a round, <= 144 new "
            f"tokens), decode_widths {narrow['decode_widths']} (16/8/4 slots) vs every slot "
            f"every step; ms a decode step at 16/8/4/2/1 slots: "
            + "/".join(f"{ms[w]:.0f}" for w in ("16", "8", "4", "2", "1")),
            f"{narrow['median_round_s']:.1f} s a round, slot use {narrow['slot_use']:.0%}",
            f"{full['median_round_s']:.1f} s, slot use {full['slot_use']:.0%}",
            f"{d['speedup']:.2f}x (same tokens {d['same_tokens_frac']:.0%})",
        )
    ]


def _train_real(d):
    goals = {"float32": 1.2, "bfloat16": 1.0}
    out = []
    for r in d["rows"]:
        how = ""
        if r["dtype"] != "float32":
            head = r.get("head_dtype", "float32").replace("float32", "f32").replace("bfloat", "bf")
            how = f" (f32 params, bf16 compute, {head} LM head; torch autocast)"
        theirs = "-" if "torch_s" not in r else f"{r['torch_tok_s']:.0f} ({r['torch_s']:.0f} s)"
        ratio = "-" if "ratio" not in r else f"{r['ratio']:.2f}x (goal >= {goals[r['dtype']]})"
        ours = f"{r['ours_tok_s']:.0f} ({r['ours_s']:.0f} s)"
        if "ours_peak_gib" in r:
            ours += f", peak {r['ours_peak_gib']:.2f} GiB"
            theirs += f", peak {r['torch_peak_gib']:.2f} GiB"
            ratio += f"; memory {r['ours_peak_gib'] / r['torch_peak_gib']:.2f}x"
        # Older files predate remat_policy: their remat kept the attention only.
        policy = d["config"].get("remat_policy", "attention")
        out.append(
            (
                f"{REAL}: train step {r['dtype']}{how}, {d['config']['sequences']} x "
                f"{d['config']['seq_len']} tokens (ours remat keeping {policy}, torch gradient "
                "checkpointing): "
                "tokens/s",
                ours,
                theirs,
                ratio,
            )
        )
    return out


_DT = {"float32": "f32", "bfloat16": "bf16"}


def _train_xla(d):
    if "timings" in d:  # before 2026-11-28: the bf16 step only, XLA flag sets only
        rows = [dict(r, dtype="bfloat16", side=k) for k, r in d["timings"].items()]
        d = dict(d, rows=[dict(rows[0], dots_ynn=d["dots_ynn"], dots_total=d["dots_total"])])
        d["rows"] += rows[1:]
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in d["rows"]):
        by_side = {r["side"]: r for r in d["rows"] if r["dtype"] == dtype}
        dt, base, torch = _DT.get(dtype, dtype), by_side.get("default"), by_side.get("torch")
        if base and "dots_ynn" in base:
            out.append(
                (
                    f"{REAL}: {dt} train step's matmuls on XLA:CPU's YNNPACK path",
                    f"{base['dots_ynn']} of {base['dots_total']} dots",
                    "-",
                    "-",
                )
            )
        for side, r in by_side.items():
            if side == "torch" or (side == "default" and not torch):
                continue
            flags = f"`{r['xla_flags']}`" if r.get("xla_flags") else "XLA's default flags"
            vs_default = ""
            if base and side != "default":
                vs_default = f"; {base['median_s'] / r['median_s']:.2f}x XLA's default"
            out.append(
                (
                    f"{REAL}: {dt} train step with {flags}"
                    + (" vs torch" if torch else " vs XLA's default")
                    + ": seconds",
                    f"{r['median_s']:.1f} s",
                    f"{torch['median_s']:.1f} s" if torch else f"{base['median_s']:.1f} s",
                    (
                        f"{torch['median_s'] / r['median_s']:.2f}x{vs_default}"
                        if torch
                        else f"{base['median_s'] / r['median_s']:.2f}x"
                    ),
                )
            )
    return out


def _real_packing(d):
    sh, un = d["shared"], d["unshared"]
    return [
        (
            f"{REAL}: train step seconds, a group's attempts sharing one prompt copy (rows of "
            f"{sh['seq_len']}, {statistics.median(sh['rows_used']):.0f} of {sh['num_rows']} "
            f"used) vs one copy per attempt ({un['num_rows']} rows of {un['seq_len']})",
            f"{sh['step_s']:.1f} s ({sh['peak_rss_gib']:.2f} GiB)",
            f"{un['step_s']:.1f} s ({un['peak_rss_gib']:.2f} GiB)",
            f"{d['speedup']:.2f}x",
        )
    ]


def _vs_trl(d):
    return _vs_peer(d, "trl", "TRL 1.16 GRPOTrainer", "TRL")


def _vs_tunix(d):
    return _vs_peer(d, "tunix", "Tunix 0.1.7 GRPOLearner", "Tunix")


def _vs_peer(d, key: str, name: str, short: str):
    """The whole RL step against a trainer library (bench_vs_trl.py, bench_vs_tunix.py)."""
    t, p, c = d[key], d["pipeline"], d["conventional"]
    lora = d.get("lora")
    if lora:  # both sides with rank-R adapters (TRL through peft)
        what = f"{REAL} LoRA r{lora['rank']} RL step vs {name} + peft LoRA r{lora['rank']}"
        return [
            (
                f"{what} (same prompts, reward, objective): pipeline mode",
                f"{p['samples_per_s']:.2f} samples/s ({p['s_per_step']:.0f} s a step)",
                f"{t['samples_per_s']:.2f} samples/s ({t['s_per_step']:.0f} s a step)",
                f"{d['samples_per_s_ratio']:.2f}x",
            ),
            (
                f"{what}: peak RSS",
                f"{p['peak_rss_gib']:.2f} GiB (pipeline)",
                f"{t['peak_rss_gib']:.2f} GiB",
                f"{d['peak_rss_ratio']:.2f}x",
            ),
        ]
    side = lambda s: (
        f"{s['samples_per_s']:.2f} samples/s, {s['completion_tokens_per_s']:.0f} "
        f"tok/s ({s['s_per_step']:.0f} s a step)"
    )
    bf16 = d.get("sampler_dtype") == "bfloat16"
    ours = f"{REAL} RL step, our sampler in bf16," if bf16 else f"{REAL} RL step"
    if d.get("compute_dtype") == "bfloat16":  # both sides train with bf16 matmuls
        ours, name = f"{REAL} RL step, bf16 compute,", f"{name} (bf16=True)"
    gap = (
        [
            (
                f"{REAL} RL run, our sampler in bf16: sampler/trainer logprob gap at equal "
                "version (mean |delta| per token, pipeline)",
                f"{p['mismatch_abs_mean']:.4f} nats",
                "-",
                "-",
            )
        ]
        if bf16 and p.get("mismatch_abs_mean") is not None
        else []
    )
    return gap + [
        (
            f"{ours} vs {name} (objective matched, same prompts, reward, "
            "16 x <=144 tokens): pipeline mode",
            side(p),
            side(t),
            f"{d['samples_per_s_ratio']:.2f}x (goal >= {d['goal']['samples_per_s_ratio']:g})",
        ),
        (
            f"{ours} vs {short}: conventional mode (one step per round)",
            side(c),
            side(t),
            f"{d['conventional_samples_per_s_ratio']:.2f}x",
        ),
        (
            f"{REAL} RL run vs {short}: peak RSS",
            f"{p['peak_rss_gib']:.2f} GiB (pipeline)",
            f"{t['peak_rss_gib']:.2f} GiB",
            f"{d['peak_rss_ratio']:.2f}x",
        ),
        (
            f"{REAL} RL run vs {short}: sampled reward, mean of the last 3 steps within "
            f"{short}'s {t['train_s'] / 60:.0f} min of training (steps done)",
            f"{p['equal_time_reward_last3']:.3f} ({p['equal_time_steps']} steps)",
            f"{t['equal_time_reward_last3']:.3f} ({t['equal_time_steps']} steps)",
            "-",
        ),
    ]


def _real_prompts(d):
    rows = {(r["variant"], r["temperature"]): r for r in d["rows"]}
    out = []
    for t in sorted({r["temperature"] for r in d["rows"]}):
        paper, shot = rows.get(("paper", t)), rows.get(("one_shot", t))
        if paper and shot:
            out.append(
                (
                    f"starting model, T={t:g}, {shot['attempts']} attempts: boxed rate / "
                    "accuracy, one worked example (the real config) vs the paper's prompt",
                    f"{shot['boxed_rate']:.2f} / {shot['accuracy']:.2f}",
                    f"{paper['boxed_rate']:.2f} / {paper['accuracy']:.2f}",
                    "-",
                )
            )
    return out


def _weight_transfer(d):
    names = {
        "bench": "bench model",
        "smollm2_135m": "SmolLM2-135M-size",
        "smollm2_135m_lora": "SmolLM2-135M LoRA r16 adapters",
    }
    rows = [
        (
            f"weights across 2 localhost processes (jax.experimental.transfer, "
            f"{r['transfer_size']} chunks), {names.get(r['model'], r['model'])} "
            f"{r['params_mb']:.0f} MB: pull MB/s",
            f"{r['pull_mb_s']:.0f} (publish call {r['publish_call_ms']:.0f} ms)",
            f"{r['device_put_mb_s']:.0f} (in-process device_put)",
            f"{r['pull_vs_device_put']:.2f}",
        )
        for r in d["rows"]
    ]
    by = {(r["model"], r["transfer_size"]): r for r in d["rows"]}
    full, adapters = by.get(("smollm2_135m", "4MiB")), by.get(("smollm2_135m_lora", "4MiB"))
    if full and adapters and adapters.get("sampler_prepare_ms"):
        rows.append(
            (
                "a swap, LoRA r16 vs the whole SmolLM2-135M: bytes, publish-to-ack across 2 "
                "processes, in-process sampler prepare",
                f"{adapters['bytes'] / 1e6:.1f} MB, {adapters['publish_to_ack_ms']:.0f} ms, "
                f"{adapters['sampler_prepare_ms']:.0f} ms",
                f"{full['bytes'] / 1e6:.0f} MB, {full['publish_to_ack_ms']:.0f} ms, "
                f"{full['sampler_prepare_ms']:.0f} ms",
                f"{full['publish_to_ack_ms'] / adapters['publish_to_ack_ms']:.0f}x / "
                f"{full['sampler_prepare_ms'] / adapters['sampler_prepare_ms']:.0f}x faster",
            )
        )
    return rows


def _multiprocess(d):
    rows = d["rows"]
    single = rows[0]
    return [
        (
            f"default config, {d['config']['steps']} steps, {r['layout']} (localhost, 2 shared "
            "cores): steady samples/s; reward first 20 steps -> last tenth; max lag (bound)",
            f"{r['steady_samples_per_s']:.0f}; {r['reward_first20']:.3f} -> "
            f"{r['reward_last_tenth']:.3f}; {r['max_lag']} ({r['lag_bound']})",
            f"{single['steady_samples_per_s']:.0f} (1 process)",
            f"{r['samples_per_s_vs_single']:.2f}",
        )
        for r in rows[1:]
    ]


SECTIONS = (
    ("forward", "python bench/bench_forward.py", "transformers", _forward),
    ("decode", "python bench/bench_decode.py", "transformers generate", _decode),
    ("decode_real", "python bench/bench_decode_real.py", "transformers generate", _decode_real),
    ("projections", "python bench/bench_projections.py", "torch", _projections),
    ("matvec_forms", "python bench/bench_matvec_forms.py", "torch F.linear", _matvec_forms),
    ("train_step", "python bench/bench_train_step.py", "torch + transformers", _train),
    ("gemm", "python bench/bench_gemm.py", "torch", _gemm),
    ("pipeline_vs_conventional", "python bench/bench_pipeline.py", "conventional mode", _pipeline),
    ("demo_seeds", "python bench/demo_seeds.py", "criterion", _demo),
    (
        "demo_seeds_deterministic",
        "python bench/demo_seeds.py --set=deterministic=true",
        "criterion",
        _demo,
    ),
    (
        "demo_seeds_guess",
        "python bench/demo_seeds.py --config=configs/guess.py",
        "criterion",
        _guess_seeds,
    ),
    ("bench_episodes", "python bench/bench_episodes.py", "conventional mode", _episodes),
    ("plan_validation", "python bench/bench_plan_validation.py", "planner", _plan),
    ("real_profile", "python bench/real_profile.py", "serial prediction", _real_profile),
    ("decode_widths", "python bench/bench_decode_widths.py", "every slot", _decode_widths),
    ("real_learning", "python bench/real_learning.py", "goals", _real_learning),
    ("real_calculator", "python bench/real_calculator.py", "the starting model", _real_calculator),
    (
        "real_calculator_large",
        "python bench/real_calculator.py --name=real_calculator_large",
        "the starting model",
        _real_calculator,
    ),
    ("real_prompts", "python bench/real_prompts.py", "paper's prompt", _real_prompts),
    (
        "train_step_real",
        "python bench/bench_train_step.py --model_dir=models/SmolLM2-135M-Instruct",
        "torch + transformers",
        _train_real,
    ),
    ("train_step_xla", "python bench/train_step_xla.py", "XLA's default flags", _train_xla),
    ("real_packing", "python bench/real_packing.py", "one prompt copy per attempt", _real_packing),
    ("vs_tunix", "python bench/bench_vs_tunix.py", "Tunix GRPOLearner", _vs_tunix),
    ("vs_trl", "python bench/bench_vs_trl.py", "TRL GRPOTrainer", _vs_trl),
    (
        "real_learning_lora",
        "python bench/real_learning.py --name=real_learning_lora",
        "full fine-tune",
        _real_learning_vs_full("with LoRA"),
    ),
    (
        "real_run_memory",
        "python bench/real_learning.py --name=real_run_memory --seeds=0",
        "full fine-tune",
        _real_learning_vs_full("full fine-tune, one seed rerun for its memory"),
    ),
    (
        "real_learning_bf16_sampler",
        "python bench/real_learning.py --name=real_learning_bf16_sampler --seeds=0 "
        "--set=sampler.compute_dtype=bfloat16",
        "full fine-tune, f32 sampler",
        _real_learning_vs_full("with a bf16 sampler"),
    ),
    (
        "real_learning_bf16",
        "python bench/real_learning.py --name=real_learning_bf16 --seeds=0 "
        "--set=model.compute_dtype=bfloat16",
        "full fine-tune, f32 compute",
        _real_learning_vs_full("with bf16 compute (trainer and sampler)"),
    ),
    ("vs_trl_lora", "python bench/bench_vs_trl.py --lora_rank=16", "TRL + peft", _vs_trl),
    (
        "vs_trl_bf16_sampler",
        "python bench/bench_vs_trl.py --sampler_dtype=bfloat16",
        "TRL GRPOTrainer",
        _vs_trl,
    ),
    (
        "vs_trl_bf16",
        "python bench/bench_vs_trl.py --compute_dtype=bfloat16",
        "TRL GRPOTrainer, bf16 autocast",
        _vs_trl,
    ),
    ("lora_decode", "python bench/bench_lora_decode.py", "merged weights", _lora_decode),
    (
        "weight_transfer",
        "python bench/bench_weight_transfer.py",
        "in-process device_put",
        _weight_transfer,
    ),
    ("multiprocess", "python bench/bench_multiprocess.py", "one process", _multiprocess),
    ("filtering", "python bench/bench_filtering.py", "no filtering", _filtering),
    *(
        (
            f"filtering_demo_seed{seed}",
            f"python bench/bench_filtering.py --seed={seed} --name=demo_seed{seed}",
            "no filtering",
            _filtering,
        )
        for seed in (1, 2)
    ),
    (
        "filtering_real_lora",
        "python bench/bench_filtering.py --config=configs/smollm2_math.py --name=real_lora",
        "no filtering",
        _filtering,
    ),
    ("elastic", "python bench/bench_elastic.py", "before the kill", _elastic),
    (
        "deterministic",
        "python bench/bench_deterministic.py",
        "default pipeline mode",
        _deterministic,
    ),
)


def table() -> str:
    lines = [
        "| measured | ours | peer | ratio | command (load) | machine |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, command, peer, render in SECTIONS:
        d = _load(name)
        if d is None:
            lines.append(f"| {name}: not measured yet | - | {peer} | - | `{command}` | - |")
            continue
        for result in (d, *_other_machines(name, d)):
            # The full command line the result recorded (common.write_result), if it did.
            recorded = str(result.get("command", ""))
            shown = recorded if recorded.startswith("python ") else command
            for what, ours, theirs, ratio in render(result):
                lines.append(
                    f"| {what} | {ours} | {theirs} | {ratio} | `{shown}` "
                    f"({_load_avg(result)}) | {_machine(result)} |"
                )
    return "\n".join(lines)


# The README's headline: (result, renderer, which of its rows; None: all), each shown for every
# machine kind that has the result, as in the full table.
HEADLINE = (
    ("demo_seeds", _demo, (0,)),
    ("demo_seeds_guess", _guess_seeds, (0,)),
    ("real_learning", _real_learning, (0,)),
    ("real_calculator", _real_calculator, (0,)),
    ("real_calculator_large", _real_calculator, (0,)),
    ("vs_tunix", _vs_tunix, (0,)),
    ("vs_trl", _vs_trl, (0,)),
    ("real_learning_lora", _real_learning_vs_full("with LoRA"), None),
    ("train_step_real", _train_real, (0,)),
    ("decode_real", _decode_real_range, None),
    ("real_profile", _real_profile, (0,)),
)


def headline() -> str:
    """A few rows of the full table (the real model's results first of all), for the README."""
    lines = [
        "| measured | ours | peer | ratio | machine |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, render, picks in HEADLINE:
        d = _load(name)
        if d is None:
            lines.append(f"| {name}: not measured yet | - | - | - | - |")
            continue
        for result in (d, *_other_machines(name, d)):
            rows = render(result)
            for i in range(len(rows)) if picks is None else picks:
                if i < len(rows):
                    what, ours, theirs, ratio = rows[i]
                    lines.append(f"| {what} | {ours} | {theirs} | {ratio} | {_machine(result)} |")
    return "\n".join(lines)


def _layout(r: dict) -> str:
    lay = r.get("layout") or {}
    if r["program"] == "decode_chunk":
        return f"tp {lay.get('tp', 1)}"
    if r["program"] == "train_step":
        return f"fsdp {lay.get('fsdp')} x tp {lay.get('tp')}"
    if r["program"] == "publish_prepare" or r["program"] == "publish_copy":
        return f"sampler tp {lay.get('sampler_tp')}"
    return f"fsdp {lay.get('fsdp')} x tp {lay.get('tp')}"


def _shapes(r: dict) -> str:
    s = r.get("shapes") or {}
    if r["program"] == "decode_chunk":
        return f"{s['batch']} seqs x {s['context_len']} ctx, {s['chunk_steps']} steps"
    if r["program"] == "train_step":
        return f"{s['rows']} x {s['seq_len']} tokens, {s['micro_batches']} micro"
    return "all params"


def _compile_result() -> tuple[dict | None, int]:
    d = _load("h100_compile")
    if d is None:
        return None, 0
    from pipelinerl_jax.plan.gpu_specs import gpu_spec

    return d, gpu_spec(d["gpu"]).memory_bytes


def _compile_header(d: dict) -> str:
    return (
        f"Compiled for {d['device_kind']} on a CPU machine (jax {d['jax']}, "
        f"`{d['command']}`, {str(d['date'])[:10]}, {d['total_s']:.0f} s in all):"
    )


def _peak(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("skipped"):
        return "heads do not divide"
    if not r.get("ok"):
        return "FAILED"
    return f"{r['memory']['peak_bytes'] / GiB:.1f}"


def _by_layout(records: list[dict]) -> dict:
    """{model: {(program, dtype, tp): record}}; skipped records have no dtype."""
    out: dict[str, dict] = {}
    for r in records:
        key = (r["program"], r.get("dtype"), (r.get("layout") or {}).get("tp"))
        out.setdefault(r["model"], {})[key] = r
    return out


def _gpu_runs() -> list[dict]:
    """Every bench/gpu_check*.json (bench/gpu_check.py on a lent GPU), oldest first."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("gpu_check*.json"))]
    return sorted((r for r in runs if r.get("mode") == "gpu"), key=lambda r: r["date"])


def gpu_measured() -> str:
    """What bench/gpu_check.py measured on a GPU: the kernel test, decode against transformers,
    the train step's MFU and the pipeline run. A later run's row replaces an earlier one's."""
    runs = _gpu_runs()
    if not runs:
        return "Measured on a GPU: not yet (`bash bench/gpu_check.sh` on a lent GPU machine)."
    kernel, decode, train, pipelines, cards = None, {}, {}, [], []
    for r in runs:
        st, env = r["stages"], r["stages"].get("env", {})
        card = f"{env.get('device_kind', '?')}, {r['date'][:10]}"
        cards.append(card)
        if st.get("kernel_test", {}).get("status") in ("ok", "failed"):
            kernel = (st["kernel_test"], card)
        for row in st.get("decode", {}).get("rows", []):
            decode[(row["model"], row["batch"])] = (row, card)
        for row in st.get("train", {}).get("rows", []):
            rank = (row.get("lora") or {}).get("rank", 0)
            train[(row["model"], rank, row["rows"], row["seq_len"])] = (row, card)
        if st.get("pipeline", {}).get("status") == "ok":  # every run: they vary by machine
            pipelines.append((st["pipeline"], card))
    lines = [
        f"Measured on a GPU (`bash bench/gpu_check.sh`; {'; '.join(dict.fromkeys(cards))}):",
        "",
    ]
    if kernel:
        k, card = kernel
        errs = ", ".join(
            f"{name} {c['max_err']:.1e}{'' if c['passed'] else ' FAIL'}"
            for name, c in k["configs"].items()
        )
        lines += [
            f"- Triton paged-attention kernel against the jnp reference ({card}): "
            f"{'passed' if k['passed'] else 'FAILED'}; max error {errs}.",
        ]
    for p, card in pipelines:
        s = p["summary"]
        lines.append(
            f"- Demo pipeline run ({card}): {p['steps_done']} steps in {p['wall_s']:.0f} s, "
            f"{s['steady_samples_per_s']:.0f} samples/s after warm-up, {p['swaps']} in-flight "
            f"swaps (sampler pause {p['swap_pause_ms_mean']:.2f} ms each), max lag "
            f"{p['lag_max']} (bound {p['lag_bound']}), reward {p['reward_start']:.3f} -> "
            f"{p['reward_end']:.3f}."
        )
    if decode:
        lines += [
            "",
            "| decode (bf16, 64-token prompts, 128 new) | batch | ours tok/s | transformers "
            "tok/s | ratio | of roofline |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for (model, batch), (row, _card) in sorted(decode.items()):
            lines.append(
                f"| {model} | {batch} | {row['ours_tok_s']:.0f} | {row['hf_tok_s']:.0f} | "
                f"{row['ratio']:.1f}x | {row['ours_frac_of_predicted']:.2f} |"
            )
    if train:
        lines += [
            "",
            "| train step (bf16 compute, f32 master) | rows x seq | tok/s | MFU | of roofline |",
            "| --- | --- | --- | --- | --- |",
        ]
        for (model, rank, rows, seq), (row, _card) in sorted(train.items()):
            what = f"{model}, LoRA rank {rank} (base frozen)" if rank else model
            lines.append(
                f"| {what} | {rows} x {seq} | {row['tok_s']:.0f} | {row['mfu']:.3f} | "
                f"{row['frac_of_predicted']:.2f} |"
            )
    return "\n".join(lines)


def gpu_summary() -> str:
    """One row per model: the README's view of bench/results/h100_compile.json, then what
    bench/gpu_check.py measured on a GPU."""
    return f"{_compiled_summary()}\n\n{gpu_measured()}"


def _compiled_summary() -> str:
    d, _ = _compile_result()
    if d is None:
        return "GPU programs: not compiled yet (`make compile-h100`)."
    records = d["records"]
    decode_shapes = next(r["shapes"] for r in records if r["program"] == "decode_chunk" and r["ok"])
    train_shapes = next(r["shapes"] for r in records if r["program"] == "train_step")
    lines = [
        _compile_header(d),
        "",
        f"| model | decode chunk at tp 1 / 2 / 8, GiB per device ({decode_shapes['batch']} "
        f"seqs x {decode_shapes['context_len']}) | train step f32 / bf16, GiB per device "
        f"(FSDP 4 x TP 2, {train_shapes['rows']} x {train_shapes['seq_len']}) | publish: GiB "
        "each sampler device receives | programs compiled |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model, recs in _by_layout(records).items():
        decode = [
            recs.get(("decode_chunk", "bfloat16", tp)) or recs.get(("decode_chunk", None, tp))
            for tp in (1, 2, 8)
        ]
        compiled_decode = [r for r in decode if r and r.get("ok")]
        kernel = "" if all(r["triton_kernel"] for r in compiled_decode) else " (no kernel!)"
        train = [recs.get(("train_step", dtype, 2)) for dtype in ("float32", "bfloat16")]
        copy = next((r for key, r in recs.items() if key[0] == "publish_copy"), None)
        received = f"{copy['bytes_per_device'] / GiB:.2f} ({copy['dtype']})" if copy else "-"
        # Compiled programs and failed ones; not the skips, nor the copy (no program).
        tried = [r for r in recs.values() if "memory" in r or r.get("ok") is False]
        compiled = sum(1 for r in tried if r.get("ok"))
        lines.append(
            f"| {model} | {' / '.join(_peak(r) for r in decode)}{kernel} | "
            f"{' / '.join(_peak(r) for r in train)} | {received} | {compiled} of {len(tried)} |"
        )
    failed = sum(1 for r in records if r.get("ok") is False)
    decodes = [r for r in records if r["program"] == "decode_chunk" and r.get("ok")]
    with_kernel = sum(1 for r in decodes if r.get("triton_kernel"))
    lines += [
        "",
        f"{with_kernel} of {len(decodes)} decode chunks have the Triton kernel in their program; "
        f"{failed} program(s) failed. "
        "Each program's row (collectives, roofline time, compile seconds) is in "
        "docs/gpu_compile.md.",
    ]
    return "\n".join(lines)


def gpu_table() -> str:
    """The GPU programs compiled for H100 topologies (bench/compile_h100.py), one row each."""
    d, memory = _compile_result()
    if d is None:
        return "GPU programs: not compiled yet (`make compile-h100`)."
    lines = [
        _compile_header(d),
        "",
        "| program | model | devices | shapes | dtype | compiled | peak GiB / device "
        "(args, temp) | fits 80 GB | roofline ms | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in d["records"]:
        head = f"| {r['program']} | {r['model']} | {r['devices']} ({_layout(r)}) |"
        if r.get("skipped"):
            lines.append(f"{head} - | - | skipped | - | - | - | {r['skipped']} |")
            continue
        if not r.get("ok"):
            lines.append(
                f"{head} {_shapes(r)} | {r.get('dtype')} | FAILED | - | - | - | {r.get('error')} |"
            )
            continue
        if "memory" not in r:  # the cross-mesh copy: bytes, no program
            gib = r["bytes_per_device"] / GiB
            lines.append(
                f"{head} all params | {r['dtype']} | no program | {gib:.2f} received "
                "| - | - | jax.device_put between meshes |"
            )
            continue
        m = r["memory"]
        notes = []
        if r.get("triton_kernel"):
            notes.append("Triton kernel in program")
        if r.get("collectives"):
            notes.append(", ".join(r["collectives"]))
        if r.get("involuntary_remats"):
            notes.append(f"{r['involuntary_remats']} involuntary remat")
        roof = f"{r['roofline_s'] * 1e3:.1f}" if r.get("roofline_s") else "-"
        lines.append(
            f"{head} {_shapes(r)} | {r['dtype']} | yes, {r['compile_s']:.0f} s | "
            f"{m['peak_bytes'] / GiB:.2f} ({m['argument_bytes'] / GiB:.2f}, "
            f"{m['temp_bytes'] / GiB:.2f}) | {'yes' if m['peak_bytes'] <= memory else 'NO'} | "
            f"{roof} | {'; '.join(notes)} |"
        )
    return "\n".join(lines)


def _replace(content: str, begin: str, end: str, text: str) -> str | None:
    if begin not in content or end not in content:
        return None
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{text}\n{end}{tail}"


def targets() -> tuple:
    """(file, ((begin, end, text), ...)) for every generated table."""
    return (
        (
            ROOT / "README.md",
            (
                (PEERS_BEGIN, PEERS_END, peer_table.render(RESULTS)),
                (HEADLINE_BEGIN, HEADLINE_END, headline()),
                (GPU_BEGIN, GPU_END, gpu_summary()),
            ),
        ),
        (
            ROOT / "docs" / "benchmarks.md",
            ((PEERS_BEGIN, PEERS_END, peer_table.render(RESULTS)), (BEGIN, END, table())),
        ),
        (ROOT / "docs" / "gpu.md", ((GPU_BEGIN, GPU_END, gpu_summary()),)),
        (ROOT / "docs" / "gpu_compile.md", ((GPU_BEGIN, GPU_END, gpu_table()),)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write",
        "--readme",
        dest="write",
        action="store_true",
        help="rewrite the tables between their markers in README.md, docs/benchmarks.md, "
        "docs/gpu.md and docs/gpu_compile.md (--readme: the old name)",
    )
    args = parser.parse_args()
    print(table())
    print()
    print(gpu_table())
    if args.write:
        updated = []  # every file checked before any is written
        for path, blocks in targets():
            content = path.read_text() if path.exists() else ""
            for begin, end, body in blocks:
                replaced = _replace(content, begin, end, body)
                if replaced is None:
                    print(
                        f"{path.relative_to(ROOT)} lacks the markers {begin} ... {end}: add "
                        "them where the table goes",
                        file=sys.stderr,
                    )
                    return 2
                content = replaced
            updated.append((path, content))
        for path, content in updated:
            path.write_text(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
