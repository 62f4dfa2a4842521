"""The full table of measured figures and the README's headline rows, from every row renderer."""

from __future__ import annotations

from bench.reports import demo_rows, micro_rows, real_rows, results

SECTIONS = (
    ("forward", "python bench/bench_forward.py", "transformers", micro_rows.forward_rows),
    ("decode", "python bench/bench_decode.py", "transformers generate", micro_rows.decode_rows),
    (
        "decode_real",
        "python bench/bench_decode_real.py",
        "transformers generate",
        micro_rows.decode_real_rows,
    ),
    ("projections", "python bench/bench_projections.py", "torch", micro_rows.projections_rows),
    (
        "matvec_forms",
        "python bench/bench_matvec_forms.py",
        "torch F.linear",
        micro_rows.matvec_forms_rows,
    ),
    (
        "train_step",
        "python bench/bench_train_step.py",
        "torch + transformers",
        micro_rows.train_rows,
    ),
    ("gemm", "python bench/bench_gemm.py", "torch", micro_rows.gemm_rows),
    (
        "pipeline_vs_conventional",
        "python bench/bench_pipeline.py",
        "conventional mode",
        demo_rows.pipeline_rows,
    ),
    ("demo_seeds", "python bench/demo_seeds.py", "criterion", demo_rows.demo_rows),
    (
        "demo_seeds_deterministic",
        "python bench/demo_seeds.py --set=deterministic=true",
        "criterion",
        demo_rows.demo_rows,
    ),
    (
        "demo_seeds_guess",
        "python bench/demo_seeds.py --config=configs/guess.py",
        "criterion",
        demo_rows.guess_seeds_rows,
    ),
    (
        "bench_episodes",
        "python bench/bench_episodes.py",
        "conventional mode",
        demo_rows.episodes_rows,
    ),
    ("plan_validation", "python bench/bench_plan_validation.py", "planner", demo_rows.plan_rows),
    (
        "real_profile",
        "python bench/real_profile.py",
        "serial prediction",
        real_rows.real_profile_rows,
    ),
    (
        "decode_widths",
        "python bench/bench_decode_widths.py",
        "every slot",
        real_rows.decode_widths_rows,
    ),
    ("real_learning", "python bench/real_learning.py", "goals", real_rows.real_learning_rows),
    (
        "real_calculator",
        "python bench/real_calculator.py",
        "the starting model",
        demo_rows.real_calculator_rows,
    ),
    (
        "real_calculator_large",
        "python bench/real_calculator.py --name=real_calculator_large",
        "the starting model",
        demo_rows.real_calculator_rows,
    ),
    ("real_prompts", "python bench/real_prompts.py", "paper's prompt", real_rows.real_prompts_rows),
    (
        "train_step_real",
        "python bench/bench_train_step.py --model_dir=models/SmolLM2-135M-Instruct",
        "torch + transformers",
        micro_rows.train_real_rows,
    ),
    (
        "train_step_xla",
        "python bench/train_step_xla.py",
        "XLA's default flags",
        micro_rows.train_xla_rows,
    ),
    (
        "real_packing",
        "python bench/real_packing.py",
        "one prompt copy per attempt",
        real_rows.real_packing_rows,
    ),
    (
        "accumulation",
        "python bench/bench_accumulation.py",
        "summed accumulation",
        real_rows.accumulation_rows,
    ),
    (
        "checkpoint_memory",
        "python bench/bench_checkpoint_memory.py",
        "a background write",
        real_rows.checkpoint_memory_rows,
    ),
    ("vs_tunix", "python bench/bench_vs_tunix.py", "Tunix GRPOLearner", real_rows.vs_tunix_rows),
    ("vs_trl", "python bench/bench_vs_trl.py", "TRL GRPOTrainer", real_rows.vs_trl_rows),
    (
        "real_learning_lora",
        "python bench/real_learning.py --name=real_learning_lora",
        "full fine-tune",
        real_rows.real_learning_vs_full("with LoRA"),
    ),
    (
        "real_run_memory",
        "python bench/real_learning.py --name=real_run_memory --seeds=0",
        "full fine-tune",
        real_rows.real_learning_vs_full("full fine-tune, one seed rerun for its memory"),
    ),
    (
        "real_learning_bf16_sampler",
        "python bench/real_learning.py --name=real_learning_bf16_sampler --seeds=0,1,2 "
        "--set=sampler.compute_dtype=bfloat16",
        "full fine-tune, f32 sampler",
        real_rows.real_learning_vs_full("with a bf16 sampler"),
    ),
    (
        "real_learning_bf16",
        "python bench/real_learning.py --name=real_learning_bf16 --seeds=0 "
        "--set=model.compute_dtype=bfloat16",
        "full fine-tune, f32 compute",
        real_rows.real_learning_vs_full("with bf16 compute (trainer and sampler)"),
    ),
    (
        "vs_trl_lora",
        "python bench/bench_vs_trl.py --lora_rank=16",
        "TRL + peft",
        real_rows.vs_trl_rows,
    ),
    (
        "vs_trl_bf16_sampler",
        "python bench/bench_vs_trl.py --sampler_dtype=bfloat16",
        "TRL GRPOTrainer",
        real_rows.vs_trl_rows,
    ),
    (
        "vs_trl_bf16",
        "python bench/bench_vs_trl.py --compute_dtype=bfloat16",
        "TRL GRPOTrainer, bf16 autocast",
        real_rows.vs_trl_rows,
    ),
    (
        "lora_decode",
        "python bench/bench_lora_decode.py",
        "merged weights",
        real_rows.lora_decode_rows,
    ),
    (
        "weight_transfer",
        "python bench/bench_weight_transfer.py",
        "in-process device_put",
        real_rows.weight_transfer_rows,
    ),
    (
        "multiprocess",
        "python bench/bench_multiprocess.py",
        "one process",
        demo_rows.multiprocess_rows,
    ),
    ("filtering", "python bench/bench_filtering.py", "no filtering", demo_rows.filtering_rows),
    *(
        (
            f"filtering_demo_seed{seed}",
            f"python bench/bench_filtering.py --seed={seed} --name=demo_seed{seed}",
            "no filtering",
            demo_rows.filtering_rows,
        )
        for seed in (1, 2)
    ),
    (
        "filtering_real_lora",
        "python bench/bench_filtering.py --config=configs/smollm2_math.py --name=real_lora",
        "no filtering",
        demo_rows.filtering_rows,
    ),
    ("elastic", "python bench/bench_elastic.py", "before the kill", demo_rows.elastic_rows),
    (
        "deterministic",
        "python bench/bench_deterministic.py",
        "default pipeline mode",
        demo_rows.deterministic_rows,
    ),
)


def table() -> str:
    lines = [
        "| measured | ours | peer | ratio | command (load) | machine |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, command, peer, render in SECTIONS:
        d = results.load(name)
        if d is None:
            lines.append(f"| {name}: not measured yet | - | {peer} | - | `{command}` | - |")
            continue
        for result in (d, *results.other_machines(name, d)):
            # The full command line the result recorded (common.write_result), if it did.
            recorded = str(result.get("command", ""))
            shown = recorded if recorded.startswith("python ") else command
            for what, ours, theirs, ratio in render(result):
                lines.append(
                    f"| {what} | {ours} | {theirs} | {ratio} | `{shown}` "
                    f"({results.load_avg(result)}) | {results.machine(result)} |"
                )
    return "\n".join(lines)


# The README's headline: (result, renderer, which of its rows; None: all), each shown for every
# machine kind that has the result, as in the full table.
HEADLINE = (
    ("demo_seeds", demo_rows.demo_rows, (0,)),
    ("demo_seeds_guess", demo_rows.guess_seeds_rows, (0,)),
    ("real_learning", real_rows.real_learning_rows, (0,)),
    ("real_calculator", demo_rows.real_calculator_rows, (0,)),
    ("real_calculator_large", demo_rows.real_calculator_rows, (0,)),
    ("vs_tunix", real_rows.vs_tunix_rows, (0,)),
    ("vs_trl", real_rows.vs_trl_rows, (0,)),
    ("real_learning_lora", real_rows.real_learning_vs_full("with LoRA"), None),
    ("train_step_real", micro_rows.train_real_rows, (0,)),
    ("decode_real", micro_rows.decode_real_range_rows, None),
    ("real_profile", real_rows.real_profile_rows, (0,)),
)


def headline() -> str:
    """A few rows of the full table (the real model's results first of all), for the README."""
    lines = [
        "| measured | ours | peer | ratio | machine |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, render, picks in HEADLINE:
        d = results.load(name)
        if d is None:
            lines.append(f"| {name}: not measured yet | - | - | - | - |")
            continue
        for result in (d, *results.other_machines(name, d)):
            rows = render(result)
            for i in range(len(rows)) if picks is None else picks:
                if i < len(rows):
                    what, ours, theirs, ratio = rows[i]
                    lines.append(
                        f"| {what} | {ours} | {theirs} | {ratio} | {results.machine(result)} |"
                    )
    return "\n".join(lines)
