"""Rows of the real model's RL benchmarks: profile, learning (and its variants), decode widths,
packing, prompts, LoRA decode, weight transfer, and the peers TRL and Tunix."""

from __future__ import annotations

import statistics

from bench.reports import results
from bench.reports.results import REAL


def real_profile_rows(d):
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


def real_learning_rows(d):
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


def real_learning_vs_full(what: str):
    """A variant's run (`what`: "with LoRA", ...) against the full fine-tune's gain
    (real_learning.json, f32 sampler), with its memory."""
    return lambda d: _real_learning_variant(d, what)


def _real_learning_variant(d, what: str):
    full = results.load("real_learning")
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


def lora_decode_rows(d):
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


def decode_widths_rows(d):
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


def accumulation_rows(d):
    rows = {r["form"]: r for r in d["rows"]}
    ours, theirs = rows["in_place"], rows["summed"]
    same = "same first step" if d["same_first_step"] else "first step DIFFERS"
    return [
        (
            f"{REAL}: train step, {d['micro_batches']} one-row micro-batches "
            f"({d['rows_used']} used), the layers' gradients added into the accumulator in place "
            "vs the micro-batch's whole gradient then added: s a step, XLA temporaries",
            f"{ours['median_s']:.1f} s, {ours['temp_gib']:.2f} GiB",
            f"{theirs['median_s']:.1f} s, {theirs['temp_gib']:.2f} GiB",
            f"{ours['median_s'] / theirs['median_s']:.2f}x time, "
            f"{ours['temp_gib'] / theirs['temp_gib']:.2f}x memory ({same})",
        )
    ]


def checkpoint_memory_rows(d):
    rows = {r["form"]: r for r in d["rows"]}
    ours, theirs = rows["sync_bounded"], rows["async"]
    return [
        (
            f"{REAL}: saving a checkpoint of the {ours['state_gib']:.1f} GiB train state, "
            "the next step donating it: peak RSS above the state, s until written "
            f"(written in place with {ours['inflight_bytes'] / 2**20:.0f} MiB in flight, the "
            "CPU default, vs written in the background from a host copy)",
            f"+{ours['peak_growth_gib']:.2f} GiB, {ours['written_s']:.1f} s",
            f"+{theirs['peak_growth_gib']:.2f} GiB, {theirs['written_s']:.1f} s",
            f"{ours['peak_growth_gib'] / theirs['peak_growth_gib']:.2f}x memory, "
            f"{ours['written_s'] / theirs['written_s']:.2f}x time",
        )
    ]


def real_packing_rows(d):
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


def vs_trl_rows(d):
    return _vs_peer(d, "trl", "TRL 1.16 GRPOTrainer", "TRL")


def vs_tunix_rows(d):
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


def real_prompts_rows(d):
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


def weight_transfer_rows(d):
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
