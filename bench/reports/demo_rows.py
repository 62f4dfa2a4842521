"""Rows of the demo and small-model benchmarks: pipeline vs conventional, seeds, episodes, the
planner, filtering, determinism, elasticity and several processes."""

from __future__ import annotations


def pipeline_rows(d):
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


def demo_rows(d):
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


def guess_seeds_rows(d):
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


def real_calculator_rows(d):
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


def episodes_rows(d):
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


def plan_rows(d):
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


def filtering_rows(d):
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


def deterministic_rows(d):
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


def elastic_rows(d):
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


def multiprocess_rows(d):
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
