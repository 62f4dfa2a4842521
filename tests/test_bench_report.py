"""bench/report.py (and bench/reports/): the tables come from result files, and say so when one
is missing.

The full table goes to docs/benchmarks.md, a headline of its rows and the GPU summary to
README.md, every compiled GPU program to docs/gpu_compile.md; all or nothing, and the
committed files hold what the committed results render to."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench.reports import results  # noqa: E402


def test_table_renders_results_and_marks_missing_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    decode = {
        "load_before": {"loadavg_1m": 0.25},
        "date": "2026-11-24T22:32:20+00:00",
        "cpu": {"model": "Intel(R) Xeon(R) Processor", "amx_bf16": True},
        "rows": [
            {
                "batch": 8,
                "dtype": "float32",
                "ours_tok_s": 300.4,
                "hf_tok_s": 150.2,
                "ratio": 2.0,
                "frac_f32_matmul_peak": 0.2,
            }
        ],
        "param_swap": {"batch": 8, "extra_cost_in_decode_steps": 0.31, "recompiled": False},
    }
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    text = report.table()
    assert "| decode float32, batch 8: tokens/s | 300 (20% of f32 peak) | 150 | 2.00x |" in text
    assert "0.31 decode steps" in text and "(0.2)" in text
    assert "| Intel Xeon (AMX), 2026-11-24 |" in text  # which machine made the figure
    assert "forward: not measured yet" in text  # no forward.json: no number invented
    (tmp_path / "forward.json").write_text(
        json.dumps(
            {
                "date": "2026-11-22T04:01:32",
                "rows": [
                    {
                        "impl": "pipelinerl_jax",
                        "dtype": "float32",
                        "tokens_per_s": 884.0,
                        "frac_f32_peak": 0.62,
                        "median_s": 1.0,
                    },
                    {
                        "impl": "transformers",
                        "dtype": "float32",
                        "tokens_per_s": 1009.0,
                        "median_s": 1.14,
                    },
                ],
            }
        )
    )
    assert "| cpu not recorded, 2026-11-22 |" in report.table()  # older results say so
    decode["command"] = "python bench/bench_decode.py --batches 8"
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    assert "`python bench/bench_decode.py --batches 8` (0.2)" in report.table()


def test_readme_without_markers_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    (tmp_path / "README.md").write_text("# no table here\n")
    monkeypatch.setattr(sys, "argv", ["report.py", "--readme"])
    assert report.main() == 2
    assert "lacks the markers" in capsys.readouterr().err
    assert (tmp_path / "README.md").read_text() == "# no table here\n"  # untouched


def test_real_model_rows(tmp_path, monkeypatch):
    """The real-model results render against their goals: memory, compiles, pipeline vs
    serial, the learning result and the starting model's prompts."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    profile = {
        "warm_cache": False,
        "serial_s_per_step": 50.0,
        "pipeline_over_serial": 0.8,
        "goal_pipeline_over_serial": 0.8,
        "alone": {"sampler_tokens_per_s": 100.0, "train_step_s": 40.0},
        "pipeline": {
            "peak_rss_gib": 4.5,
            "seconds_to_first_step": 95.0,
            "compile_seconds_by_step": [30.0, 5.0, 0, 0],
            "compiles_by_step": [20, 1, 0, 0],
            "compiles_after_warmup": 0,
            "steady_generated_tokens_per_step": 1000.0,
            "pipeline_tokens_per_s": 16.0,
            "steady_s_per_step": 62.5,
            "idle_slot_fraction": 0.25,
            "per_step_seconds": {"decode": 9.0, "train_step": 41.0},
        },
    }
    (tmp_path / "real_profile.json").write_text(json.dumps(profile))
    learning = {
        "goals": {"accuracy": 0.1, "boxed": 0.3},
        "runs": [
            {
                "steps": 24,
                "accuracy_before": 0.4,
                "accuracy_after": 0.55,
                "boxed_before": 0.9,
                "boxed_after": 1.0,
                "train": [{"time": 1500.0}],
            },
            {
                "steps": 24,
                "accuracy_before": 0.4,
                "accuracy_after": 0.45,
                "boxed_before": 0.9,
                "boxed_after": 0.95,
                "train": [{"time": 1700.0}],
                "wall_s": 1800.0,
                "zero_shot_after": {"accuracy": 0.3, "boxed": 0.7},
            },
        ],
        "zero_shot_start": {"accuracy": 0.05, "boxed": 0.1},
    }
    (tmp_path / "real_learning.json").write_text(json.dumps(learning))
    prompts = {
        "rows": [
            {
                "variant": "paper",
                "temperature": 0.8,
                "attempts": 128,
                "boxed_rate": 0.02,
                "accuracy": 0.0,
            },
            {
                "variant": "one_shot",
                "temperature": 0.8,
                "attempts": 128,
                "boxed_rate": 0.63,
                "accuracy": 0.29,
            },
        ]
    }
    (tmp_path / "real_prompts.json").write_text(json.dumps(prompts))
    train_real = {
        "config": {"sequences": 16, "seq_len": 512},
        "rows": [
            {
                "dtype": "float32",
                "ours_tok_s": 150.0,
                "torch_tok_s": 120.0,
                "ours_s": 54.6,
                "torch_s": 68.3,
                "ratio": 1.25,
            }
        ],
    }
    (tmp_path / "train_step_real.json").write_text(json.dumps(train_real))
    text = report.table()
    assert "peak RSS of a whole run, f32, 16 x 288 tokens a step | 4.50 GiB |" in text
    assert "| misses |" in text  # 4.5 GiB is over the 4 GB goal
    assert "| 95 s (35 s compiling) |" in text
    assert "(steps 2-3) | 0 | 0 (goal) | meets |" in text
    assert "| 16.0 (62 s a step) | 20.0 (50 s: sampler 100 tok/s, train 40 s) | 0.80x" in text
    assert "decode 9.0, train step 41.0" in text and "idle decode slots 25%" in text
    assert (
        "after 24/24 steps, one worked example in the prompt, 2 seed(s), 30 min per run at "
        "most (launch to exit) | 0.40 -> 0.55; 0.40 -> 0.45 |"
    ) in text
    assert "| +0.10 (goal) | +0.05 .. +0.15 |" in text
    # Zero-shot rows: only the seeds that have a zero-shot score of their final policy.
    assert (
        "starting model -> each seed's final policy | 0.05 -> 0.30 | +0.10 (goal) | +0.25" in text
    )
    assert "| 0.10 -> 0.70 | +0.30 (goal) | +0.60 .. +0.60 |" in text
    assert "| 0.63 / 0.29 | 0.02 / 0.00 |" in text
    assert (
        "train step float32, 16 x 512 tokens (ours remat keeping attention, torch gradient "
        "checkpointing): "
        "tokens/s | 150 (55 s) | 120 (68 s) | 1.25x (goal >= 1.2) |"
    ) in text


def test_real_decode_rows_say_whether_each_goal_is_met(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    row = dict(batch=16, temperature=0.0, ours_tok_s=260.0, hf_tok_s=100.0, ratio=2.6)
    d = {
        "config": {"prompt_len": 64, "new_tokens": 256},
        "rows": [
            {**row, "dtype": "float32", "goal": 2.5, "same_tokens_frac": 1.0},
            {**row, "dtype": "bfloat16", "goal": 1.5, "temperature": 1.0, "ratio": 1.2},
        ],
    }
    (tmp_path / "decode_real.json").write_text(json.dumps(d))
    text = report.table()
    assert "decode float32, batch 16, greedy, 64 + 256 tokens: tokens/s | 260 (100% same" in text
    assert "| 2.60x (goal met) |" in text
    assert "bfloat16, batch 16, temperature 1" in text and "| 1.20x (goal 1.5x) |" in text


def test_each_machine_kinds_newest_result_gets_its_rows(tmp_path, monkeypatch):
    """A figure measured on the Xeon and on the AMD EPYC shows both rows, each with its machine;
    the by_machine copy of the newest result itself is not shown twice."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    (tmp_path / "by_machine").mkdir()

    def result(model, ours):
        return {
            "date": "2026-11-26T08:00:00",
            "cpu": {"model": model, "avx512f": True},
            "rows": [
                {
                    "batch": 8,
                    "dtype": "float32",
                    "ours_tok_s": ours,
                    "hf_tok_s": 100.0,
                    "ratio": ours / 100.0,
                }
            ],
            "param_swap": {"batch": 8, "extra_cost_in_decode_steps": 0.3, "recompiled": False},
        }

    xeon, epyc = result("Intel(R) Xeon(R) Processor", 140.0), result("AMD EPYC 9B14", 230.0)
    (tmp_path / "decode.json").write_text(json.dumps(xeon))
    (tmp_path / "by_machine" / "decode.xeon.json").write_text(json.dumps(xeon))
    (tmp_path / "by_machine" / "decode.epyc.json").write_text(json.dumps(epyc))
    rows = [line for line in report.table().splitlines() if line.startswith("| decode float32")]
    assert len(rows) == 2, rows
    assert "| 140 " in rows[0] and "Intel Xeon" in rows[0]
    assert "| 230 " in rows[1] and "AMD EPYC 9B14" in rows[1]


def test_gemm_rows_and_the_train_steps_remat_policy(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    row = dict(shape="q/o forward [N, E] @ [E, E]", m=8192, k=576, n=576, dtype="float32")
    gemm = {"rows": [dict(row, ours_gflops=190.4, torch_gflops=238.0, ratio=0.8)]}
    (tmp_path / "gemm.json").write_text(json.dumps(gemm))
    train = {
        "config": {"sequences": 16, "seq_len": 512, "remat_policy": "matmuls"},
        "rows": [dict(dtype="float32", ours_s=50.0, ours_tok_s=163.8, torch_s=55.0)],
    }
    train["rows"][0].update(torch_tok_s=149.0, ratio=1.1)
    (tmp_path / "train_step_real.json").write_text(json.dumps(train))
    wgrad = dict(row, shape="q/o weight gradient [E, N] @ [N, E]", m=576, k=8192)
    gemm["rows"] += [
        dict(
            wgrad, form="contract", step_form=True, ours_gflops=200.0, torch_gflops=250.0, ratio=0.8
        ),
        dict(wgrad, form="copy", step_form=False, ours_gflops=150.0, torch_gflops=250.0, ratio=0.6),
    ]
    (tmp_path / "gemm.json").write_text(json.dumps(gemm))
    text = report.table()
    assert (
        "| train-step matmul alone, float32, q/o forward [N, E] @ [E, E], M x K x N = 8192 x 576 "
        "x 576: GFLOP/s | 190 | 238 | 0.80x |"
    ) in text
    assert (
        "| train-step matmul alone, float32, q/o weight gradient [E, N] @ [N, E] (token axis "
        "contracted in place, the step's form), M x K x N = 576 x 8192 x 576: GFLOP/s | 200 | "
        "250 | 0.80x |"
    ) in text
    assert "(activations copied transposed, copy timed), M x K x N" in text
    assert "(ours remat keeping matmuls, torch gradient checkpointing)" in text


def test_train_step_xla_rows_per_dtype_and_flag_set(tmp_path, monkeypatch):
    """Each XLA flag set's step against torch's in its dtype and against XLA's default; the
    earlier result (bf16 only, flag sets only) still renders."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    flags = "--xla_cpu_experimental_ynn_fusion_type=-individual_dot"
    rows = [
        dict(dtype="float32", side="default", median_s=50.0, dots_ynn=44, dots_total=52),
        dict(dtype="float32", side="ynn_dots_off", median_s=40.0, xla_flags=flags),
        dict(dtype="float32", side="torch", median_s=70.0),
    ]
    (tmp_path / "train_step_xla.json").write_text(json.dumps({"rows": rows}))
    text = report.table()
    assert "f32 train step's matmuls on XLA:CPU's YNNPACK path | 44 of 52 dots |" in text
    assert (
        "f32 train step with XLA's default flags vs torch: seconds | 50.0 s | 70.0 s | 1.40x |"
        in text
    )
    assert (
        f"f32 train step with `{flags}` vs torch: seconds | 40.0 s | 70.0 s | 1.75x; 1.25x XLA's default |"
        in text
    )
    old = {
        "dots_ynn": 52,
        "dots_total": 52,
        "timings": {
            "default": dict(median_s=32.0, xla_flags=""),
            "onednn": dict(median_s=40.0, xla_flags="--xla_cpu_use_onednn=true"),
        },
    }
    (tmp_path / "train_step_xla.json").write_text(json.dumps(old))
    text = report.table()
    assert "bf16 train step's matmuls on XLA:CPU's YNNPACK path | 52 of 52 dots |" in text
    assert (
        "bf16 train step with `--xla_cpu_use_onednn=true` vs XLA's default: seconds | 40.0 s | 32.0 s | 0.80x |"
        in text
    )
    assert "bf16 train step with XLA's default flags" not in text


def test_gpu_compile_table(tmp_path, monkeypatch):
    """Each compiled program is a row: memory against the GPU's, the kernel's presence, and
    skips, failures and the uncompiled copy said as such, never as numbers."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert "not compiled yet" in report.gpu_table()
    mem = dict(argument_bytes=2 * 2**30, output_bytes=2**30, alias_bytes=2**30, temp_bytes=2**29)
    decode = dict(
        program="decode_chunk",
        model="qwen2.5-7b",
        devices=1,
        layout={"tp": 1},
        shapes={"batch": 128, "context_len": 2048, "chunk_steps": 16},
        dtype="bfloat16",
        ok=True,
        compile_s=12.0,
        memory={**mem, "peak_bytes": int(2.5 * 2**30)},
        triton_kernel=True,
        collectives=[],
        roofline_s=0.08,
    )
    train = dict(
        decode,
        program="train_step",
        devices=8,
        layout={"fsdp": 4, "tp": 2},
        shapes={"rows": 32, "seq_len": 1024, "micro_batches": 4},
        memory={**mem, "peak_bytes": 90 * 2**30},
        triton_kernel=False,
        collectives=["all-gather"],
    )
    records = [
        decode,
        train,
        dict(program="decode_chunk", model="m", devices=8, layout={"tp": 8}, skipped="heads"),
        dict(decode, model="broken", ok=False, error="XlaRuntimeError: boom"),
        dict(
            program="publish_copy",
            model="m",
            devices=2,
            layout={"sampler_tp": 2},
            dtype="float32",
            ok=True,
            bytes_per_device=2**30,
        ),
    ]
    payload = dict(
        gpu="h100",
        device_kind="NVIDIA H100 80GB HBM3",
        jax="0.11.2",
        command="python bench/compile_h100.py",
        date="2026-11-26T00:00:00",
        total_s=60.0,
        records=records,
    )
    (tmp_path / "h100_compile.json").write_text(json.dumps(payload))
    rows = report.gpu_table().splitlines()
    decode_row = next(r for r in rows if r.startswith("| decode_chunk | qwen2.5-7b") and "yes" in r)
    assert "2.50 (2.00, 0.50) | yes | 80.0 | Triton kernel in program" in decode_row
    train_row = next(r for r in rows if r.startswith("| train_step"))
    assert "| NO |" in train_row and "all-gather" in train_row
    assert any("skipped" in r and "heads" in r for r in rows)
    assert any("FAILED" in r and "boom" in r for r in rows)
    assert any("no program | 1.00 received" in r for r in rows)
    summary = report.gpu_summary().splitlines()
    row = next(r for r in summary if r.startswith("| qwen2.5-7b"))
    assert "| 2.5 / - / - |" in row and "| - / 90.0 |" in row and "2 of 2 |" in row
    assert "| FAILED / - / - |" in next(r for r in summary if r.startswith("| broken"))
    assert any("1 of 1 decode chunks have the Triton kernel" in r for r in summary)
    assert any("1 program(s) failed" in r for r in summary)


def _marked(*pairs) -> str:
    return "".join(f"{begin}\nold\n{end}\n" for begin, end in pairs)


def _docs_tree(tmp_path, gpu_compile: str) -> dict:
    """README.md and the generated docs pages under tmp_path; their texts."""
    (tmp_path / "docs").mkdir()
    files = {
        "README.md": "# intro\n"
        + _marked(
            (report.PEERS_BEGIN, report.PEERS_END),
            (report.HEADLINE_BEGIN, report.HEADLINE_END),
            (report.GPU_BEGIN, report.GPU_END),
        ),
        "docs/benchmarks.md": "# Benchmarks\n"
        + _marked((report.PEERS_BEGIN, report.PEERS_END), (report.BEGIN, report.END)),
        "docs/gpu.md": "# GPU\n" + _marked((report.GPU_BEGIN, report.GPU_END)),
        "docs/gpu_compile.md": gpu_compile,
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return files


def test_tables_are_written_all_or_nothing(tmp_path, monkeypatch, capsys):
    """Every file has its markers but docs/gpu_compile.md, the last one: no file is written."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    files = _docs_tree(tmp_path, "# no markers\n")
    monkeypatch.setattr(sys, "argv", ["report.py", "--write"])
    assert report.main() == 2
    assert "docs/gpu_compile.md lacks the markers" in capsys.readouterr().err
    for name, text in files.items():
        assert (tmp_path / name).read_text() == text, name


def test_each_table_goes_to_its_file(tmp_path, monkeypatch):
    """The full table to docs/benchmarks.md, the headline and the GPU summary to the README
    (--readme, the old flag, still works)."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    _docs_tree(tmp_path, "# GPU\n" + _marked((report.GPU_BEGIN, report.GPU_END)))
    monkeypatch.setattr(sys, "argv", ["report.py", "--readme"])
    assert report.main() == 0
    readme = (tmp_path / "README.md").read_text()
    bench = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert readme.startswith("# intro\n") and "old" not in readme
    assert "| measured | ours | peer | ratio | machine |" in readme
    assert "forward: not measured yet" in bench and "forward: not measured" not in readme
    assert "vs_trl: not measured yet | - | - | - | - |" in readme
    assert readme.count("no peer comparison measured yet") == 1
    assert bench.count("no peer comparison measured yet") == 1
    assert readme.count("not compiled yet") == 1  # the GPU summary
    assert "not compiled yet" in (tmp_path / "docs" / "gpu.md").read_text()
    assert "not compiled yet" in (tmp_path / "docs" / "gpu_compile.md").read_text()


def test_headline_rows_are_rows_of_the_full_table(tmp_path, monkeypatch):
    """The README's headline renders with the full table's own functions: each of its rows
    (but the decode ranges) is a row of docs/benchmarks.md less the command column."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    demo = {
        "date": "2026-11-26T08:00:00",
        "passed": True,
        "rows": [{"gain": 0.5, "process_wall_s": 60.0}, {"gain": 0.6, "process_wall_s": 70.0}],
    }
    (tmp_path / "demo_seeds.json").write_text(json.dumps(demo))
    row = dict(batch=1, temperature=0.0, ours_tok_s=40.0, hf_tok_s=20.0, ratio=2.0, goal=2.5)
    decode = {
        "config": {"prompt_len": 64, "new_tokens": 256},
        "rows": [
            {**row, "dtype": "float32"},
            {**row, "dtype": "float32", "batch": 64, "ours_tok_s": 300.0, "ratio": 2.6},
        ],
    }
    (tmp_path / "decode_real.json").write_text(json.dumps(decode))
    full, head = report.table(), report.headline()
    demo_row = next(r for r in head.splitlines() if r.startswith("| demo learns"))
    assert demo_row.rsplit(" | ", 1)[0] in full
    assert (
        "| SmolLM2-135M decode float32, batch 1/64, greedy and temperature 1, 64 + 256 tokens: "
        "tokens/s | 40-300 | 20-20 | 2.00-2.60x (goal 2.5x: met in 1 of 2) |"
    ) in head
    assert "bfloat16" not in head  # no bf16 rows measured: no row, no number


def test_committed_tables_match_the_results():
    """README.md and the docs pages hold what bench/results renders to: after a new result,
    `python bench/report.py --write` brings them up to date."""
    for path, blocks in report.targets():
        content = path.read_text()
        for begin, end, body in blocks:
            assert begin in content and end in content, (path.name, begin)
            committed = content.split(begin, 1)[1].split(end, 1)[0].strip("\n")
            assert committed == body, (
                f"{path.relative_to(ROOT)}: the table between {begin} and {end} is not what "
                "bench/results renders to; run `python bench/report.py --write`"
            )


def test_peer_table_has_a_column_per_machine_kind_and_meets_goals_only_on_both(tmp_path):
    """bench/peer_table.py: each kind's newest figure in its column, the goal judged on both."""
    from bench import peer_table

    (tmp_path / "by_machine").mkdir()
    epyc = {"cpu": {"model": "AMD EPYC"}, "date": "2026-11-25T01:00:00"}
    xeon = {"cpu": {"model": "Intel(R) Xeon(R) Processor"}, "date": "2026-11-26T01:00:00"}
    trl = {"goal": {"samples_per_s_ratio": 3.0}, "conventional_samples_per_s_ratio": 1.8}
    (tmp_path / "by_machine" / "vs_trl.epyc.json").write_text(
        json.dumps({**epyc, **trl, "samples_per_s_ratio": 3.02, "peak_rss_ratio": 0.7})
    )
    # The main file is the newest run, from the Xeon, and no by_machine copy of it exists.
    (tmp_path / "vs_trl.json").write_text(
        json.dumps({**xeon, **trl, "samples_per_s_ratio": 2.34, "peak_rss_ratio": 0.73})
    )
    (tmp_path / "by_machine" / "vs_tunix_quick.epyc.json").write_text(
        json.dumps({**epyc, "samples_per_s_ratio": 9.0, "peak_rss_ratio": 0.1})
    )  # a --quick result is never a figure
    rows = {r["what"]: r for r in peer_table.rows(tmp_path)}
    speed = rows["SmolLM2-135M RL step: samples/s, pipeline mode"]
    assert speed["ratios"] == {"epyc": 3.02, "xeon": 2.34} and speed["met"] is False
    assert rows["SmolLM2-135M RL step: peak RSS"]["met"] is True
    assert rows["SmolLM2-135M RL step: samples/s, conventional mode"]["met"] is None
    assert not any(r["peer"] == "Tunix GRPO" for r in rows.values())
    text = peer_table.render(tmp_path)
    assert "| >= 3x | 3.02x ✓ (2026-11-25) | 2.34x ✗ (2026-11-26) | **no** | Xeon: the" in text
    assert "| <= 1x | 0.70x ✓ (2026-11-25) | 0.73x ✓ (2026-11-26) | yes |  |" in text
    # One kind alone never meets a goal: the other kind has not measured it.
    (tmp_path / "vs_trl.json").unlink()
    assert "| 3.02x ✓ (2026-11-25) | not measured | **no** |" in peer_table.render(tmp_path)
    assert "no peer comparison measured yet" in peer_table.render(tmp_path / "none")


def test_peer_table_names_what_bounds_each_decode_batch(tmp_path):
    """decode_real's rows: weight reads bound batch 1, attention over the window batch 64."""
    from bench import peer_table

    (tmp_path / "by_machine").mkdir()
    row = {"dtype": "float32", "temperature": 0.0, "goal": 2.5}
    rows = [{**row, "batch": b, "ratio": r} for b, r in ((1, 2.4), (16, 2.0), (64, 1.7))]
    payload = {"cpu": {"model": "AMD EPYC"}, "date": "2026-11-28T01:00:00", "rows": rows}
    (tmp_path / "by_machine" / "decode_real.epyc.json").write_text(json.dumps(payload))
    bounds = {r["what"].split(", ")[1]: r["bound"] for r in peer_table.rows(tmp_path)}
    assert bounds["batch 1"].startswith("reading every weight")
    assert "skinny shapes" in bounds["batch 16"]
    assert bounds["batch 64"].startswith("attention over the staged K/V window")
    # A row written with its own date (bench/row_results.py) shows that date, not the file's.
    payload["rows"] = [{**rows[0], "dtype": "bfloat16", "date": "2026-11-29T02:00:00"}]
    (tmp_path / "by_machine" / "decode_real.epyc.json").write_text(json.dumps(payload))
    (row,) = peer_table.rows(tmp_path)
    assert row["bound"].startswith("reading every weight")
    assert row["dates"] == {"epyc": "2026-11-29"}


def test_unmet_decode_goals_say_what_they_would_need_of_the_machine(tmp_path):
    """An f32 decode row that misses its goal says, from its own numbers, what the goal asks:
    a weight read rate at batch 1 (every f32 weight read once a token), a share of the
    machine's f32 matmul rate above it. Rows that meet the goal and bf16 rows say nothing."""
    from bench import peer_table

    (tmp_path / "by_machine").mkdir()
    base = {"dtype": "float32", "temperature": 0.0, "goal": 2.5}
    rows = [
        # 2e8 FLOP a token = 1e8 f32 weights = 0.4 GB a token: 2.5 x 16 tok/s needs 16.0 GB/s.
        {**base, "batch": 1, "ours_tok_s": 38.0, "hf_tok_s": 16.0, "ratio": 38 / 16},
        # 35% of the rate at 220 tok/s; 2.5 x 110 = 275 tok/s needs 0.35 * 275 / 220 = 43.75%.
        {**base, "batch": 16, "ours_tok_s": 220.0, "hf_tok_s": 110.0, "ratio": 2.0}
        | {"ours_frac_f32_matmul_peak": 0.35},
        {**base, "batch": 8, "ours_tok_s": 300.0, "hf_tok_s": 100.0, "ratio": 3.0}
        | {"ours_frac_f32_matmul_peak": 0.5},
        {**base, "batch": 64, "dtype": "bfloat16", "goal": 1.5, "ratio": 1.2}
        | {"ours_tok_s": 120.0, "hf_tok_s": 100.0, "ours_frac_f32_matmul_peak": 0.4},
    ]
    payload = {
        "cpu": {"model": "AMD EPYC"},
        "date": "2026-11-28T01:00:00",
        "rows": rows,
        "flop_per_token": 2e8,
    }
    (tmp_path / "by_machine" / "decode_real.epyc.json").write_text(json.dumps(payload))
    found = {r["what"].split(" decode ")[1].split(":")[0]: r for r in peer_table.rows(tmp_path)}
    b1 = found["float32, batch 1, greedy"]
    assert b1["unmet_bound"].endswith("; AMD EPYC: 2.5x needs 16.0 GB/s of weight reads, ours 15.2")
    b16 = found["float32, batch 16, greedy"]["unmet_bound"]
    assert b16.endswith(
        "; AMD EPYC: 2.5x needs 44% of the machine's f32 matmul rate over the whole step, ours 35%"
    )
    assert b16.startswith("the projections at decode's skinny shapes")
    # Met here, unmet only because the Xeon has not measured it: nothing to say of the EPYC.
    assert "needs" not in found["float32, batch 8, greedy"]["unmet_bound"]
    assert "needs" not in found["bfloat16, batch 64, greedy"]["unmet_bound"]
    assert "ours 15.2 |" in peer_table.render(tmp_path)


def test_accumulation_rows_say_time_memory_and_whether_the_step_matched(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    rows = [
        dict(form="in_place", median_s=20.0, temp_gib=1.0, first_loss=0.5, first_grad_norm=2.0),
        dict(form="summed", median_s=25.0, temp_gib=1.6, first_loss=0.5, first_grad_norm=2.0),
    ]
    d = dict(micro_batches=16, rows_used=4, rows=rows, same_first_step=True)
    (tmp_path / "accumulation.json").write_text(json.dumps(d))
    assert (
        "| 20.0 s, 1.00 GiB | 25.0 s, 1.60 GiB | 0.80x time, 0.62x memory (same first step) |"
    ) in report.table()
    (tmp_path / "accumulation.json").write_text(json.dumps(dict(d, same_first_step=False)))
    assert "(first step DIFFERS)" in report.table()


def test_checkpoint_memory_rows_compare_the_cpu_default_with_a_background_write(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    rows = [
        dict(form="async", state_gib=1.5, inflight_bytes=None, peak_growth_gib=2.0, written_s=2.0),
        dict(
            form="sync_unbounded",
            state_gib=1.5,
            inflight_bytes=None,
            peak_growth_gib=0.4,
            written_s=1.9,
        ),
        dict(
            form="sync_bounded",
            state_gib=1.5,
            inflight_bytes=2**28,
            peak_growth_gib=0.25,
            written_s=1.5,
        ),
    ]
    (tmp_path / "checkpoint_memory.json").write_text(json.dumps(dict(rows=rows)))
    table = report.table()
    assert "with 256 MiB in flight" in table
    assert "| +0.25 GiB, 1.5 s | +2.00 GiB, 2.0 s | 0.12x memory, 0.75x time |" in table
