"""plan/roofline.py, gpu_memory.py, gpu_profile.py and `python -m pipelinerl_jax.plan --gpu`:
predicted GPU time and memory.

Costs are checked against sums written out by hand on the 2-layer test model, the decode FLOP
formula against XLA's own count of a forward pass, and the CLI end to end on Qwen2.5-7B over
128 H100s at the paper's case-study setting (plan/paper.py: N = B = 128, L = 8192, lag 132).
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from pipelinerl_jax.models import decoder, param_counts
from pipelinerl_jax.models.known_shapes import known_config
from pipelinerl_jax.plan import gpu_memory, gpu_profile, layout, model, paper, roofline
from pipelinerl_jax.plan import utilisation as util
from pipelinerl_jax.plan.gpu_specs import gpu_spec
from tests.tiny_models import model_config

H100 = gpu_spec("h100")
# Tiny: L=2, E=32, F=64, H=4, K=2, D=8, V=64, untied head, f32 params and compute.
TINY = model_config()
P_LAYERS = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64)  # q, k+v, o, gate+up+down
P_ALL = P_LAYERS + 2 * 2 * 32 + 32 + 2 * 64 * 32  # + layer norms, final norm, embed and head


def test_param_counts_the_costs_build_on():
    assert param_counts.matmul_params_per_token(TINY) == P_LAYERS + 32 * 64
    assert param_counts.num_params(TINY) == P_ALL


def test_decode_step_cost_by_hand():
    c = roofline.decode_step_cost(TINY, batch=4, context_len=10)  # bf16 weights and cache
    # matmuls 2 B (P_L + E V); attention 4 B ctx H D L
    assert c.flops == 2 * 4 * (P_LAYERS + 32 * 64) + 4 * 4 * 10 * 4 * 8 * 2
    layers = (P_ALL - 2 * 64 * 32) * 2  # every per-layer param and the final norm, bf16
    head = 64 * 32 * 4  # the sampler's f32 head
    embed_rows = 4 * 32 * 2  # only the B embedding rows the step looks up
    kv = 4 * (10 + 1) * (2 * 2 * 2 * 8 * 2)  # read ctx tokens, write one; K and V, L, K, D, bf16
    logits = 4 * 64 * 4
    assert c.bytes == layers + head + embed_rows + kv + logits


def test_decode_step_cost_splits_over_tp():
    one = roofline.decode_step_cost(TINY, batch=8, context_len=100, tp=1)
    two = roofline.decode_step_cost(TINY, batch=8, context_len=100, tp=2)
    assert two.flops == pytest.approx(one.flops / 2)  # V = 64 splits by vocabulary too
    # Everything splits but the embedding, which every device holds whole.
    embed = 8 * 32 * 2
    assert two.bytes - embed / 2 == pytest.approx((one.bytes - embed) / 2 + embed / 2)


def test_train_step_cost_by_hand():
    c = roofline.train_step_cost(
        TINY, tokens=32, seq_len=16, remat=True, devices=2, attention_block=4
    )
    rows = 2
    # Blocked causal attention at block 4 over 16 tokens: query blocks of 4 see 4, 8, 12, 16 keys.
    pairs = 4 * 4 + 4 * 8 + 4 * 12 + 4 * 16
    assert roofline.attention_pairs(16, 4) == pairs
    # remat policy "attention" recomputes the projections: 8 P_L a token; head 6 E V; attention
    # 7 matmuls of 2 pairs D per head, layer and row.
    flops = 8 * P_LAYERS * 32 + 6 * 32 * 64 * 32 + 7 * 2 * pairs * 4 * 8 * 2 * rows
    assert c.flops == pytest.approx(flops / 2)
    per_token = 4 * 4 * 2 * (6 * 32 + 2 * 4 * 8 + 2 * 2 * 8 + 3 * 64) + 16 * 64  # 4 passes, f32
    scores = roofline.SCORE_BYTES_PER_PAIR * pairs * 4 * 2 * rows
    nbytes = 28 * P_ALL / 2 + P_ALL * (3 * 4 + 4) + (per_token * 32 + scores) / 2
    assert c.bytes == pytest.approx(nbytes)
    # "matmuls" saves the projections' outputs: no recompute, 6 P_L a token and 3 passes.
    saved = roofline.train_step_cost(
        model_config(remat=True, remat_policy="matmuls"), tokens=32, seq_len=16, devices=2
    )
    full = roofline.train_step_cost(TINY, tokens=32, seq_len=16, remat=True, devices=2)
    assert full.flops - saved.flops == pytest.approx(2 * P_LAYERS * 32 / 2)


def test_seconds_and_bound_pick_the_slower_side():
    compute = roofline.Cost(flops=989e12, bytes=1e9)  # 1 s of bf16 peak, 0.3 ms of HBM
    assert roofline.seconds(compute, H100, "bfloat16") == pytest.approx(1.0)
    assert roofline.bound(compute, H100, "bfloat16") == "compute"
    assert roofline.seconds(compute, H100, "float32") == pytest.approx(2.0)  # tf32 peak
    memory = roofline.Cost(flops=1e9, bytes=3.35e12)
    assert roofline.seconds(memory, H100, "bfloat16") == pytest.approx(1.0)
    assert roofline.bound(memory, H100, "bfloat16") == "memory"


def test_decode_flops_match_xla_cost_analysis():
    """The analytic FLOPs of a decode step at batch B T and context T are those of one full
    forward over [B, T] (each token attends to T keys through the mask). XLA counts a scanned
    body once, whatever its trip count, so the model has one layer."""
    cfg = model_config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        num_layers=1,
        max_position_embeddings=256,
    )
    graphdef, params = decoder.init(cfg, jax.random.key(0))
    B, T = 2, 64
    tokens = jnp.zeros((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    compiled = jax.jit(decoder.forward, static_argnums=0).lower(graphdef, params, tokens, positions)
    cost = compiled.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    analytic = roofline.decode_step_cost(cfg, batch=B * T, context_len=T).flops
    assert cost["flops"] == pytest.approx(analytic, rel=0.1)


def test_memory_items_by_hand():
    s = gpu_memory.memory_per_device(TINY, "sampler", tp=2, batch=6, context_len=100)
    assert s.source == "analytic"
    weights = (P_ALL - 2 * 64 * 32) * 2 // 2 + 64 * 32 * 4 // 2 + 64 * 32 * 2
    assert s.items["weights"] == s.items["staged next version"] == weights
    assert s.items["KV pool"] == 6 * 100 * 2 * 2 * 1 * 8 * 2  # K / tp = 1 head per device
    t = gpu_memory.memory_per_device(TINY, "trainer", fsdp=4, rows=1, seq_len=16)
    assert t.items["f32 master params"] == 4 * P_ALL // 4
    assert t.items["Adam moments"] == 8 * P_ALL // 4
    assert t.items["activations"] > 0 and t.fits(H100)
    assert "trainer: fits in 80 GB: yes" in t.describe(H100)


def _compile_file(tmp_path, records, fmt=gpu_memory.COMPILED_FORMAT):
    path = tmp_path / "h100_compile.json"
    path.write_text(json.dumps({"format": fmt, "gpu": "h100", "jax": "0.11.2", "records": records}))
    return path


def _record(program, devices, shapes, peak_parts=(10, 4, 4, 2), ok=True, model_name="tiny"):
    arg, out, alias, temp = (x * 2**30 for x in peak_parts)
    return {
        "program": program,
        "model": model_name,
        "devices": devices,
        "layout": {"tp": devices, "fsdp": 1},
        "shapes": shapes,
        "dtype": "bfloat16",
        "ok": ok,
        "error": None if ok else "XlaRuntimeError: boom",
        "compile_s": 4.2,
        "memory": {
            "argument_bytes": arg,
            "output_bytes": out,
            "alias_bytes": alias,
            "temp_bytes": temp,
            "generated_code_bytes": 1000,
            "peak_bytes": arg + out - alias + temp,
        },
        "flops": 1.0,
        "bytes_accessed": 1.0,
    }


def test_compiled_records_override_the_analytic_memory(tmp_path):
    shapes = {"batch": 6, "context_len": 100, "chunk_steps": 16}
    path = _compile_file(
        tmp_path,
        [
            _record("decode_chunk", 2, shapes, ok=False),  # failed compiles are not figures
            _record("decode_chunk", 2, {"batch": 64, "context_len": 2048}),
            _record("decode_chunk", 2, shapes),
            _record("train_step", 8, {"rows": 8, "seq_len": 1024}),
        ],
    )
    records = gpu_memory.load_compiled(path)
    assert len(records) == 3
    kw = dict(compiled=records, model="tiny", gpu="h100")
    s = gpu_memory.memory_per_device(TINY, "sampler", **kw, tp=2, batch=6, context_len=100)
    assert s.source.startswith(f"compiled ({path}: decode_chunk on 2 devices")
    assert "the plan's" not in s.source  # the record at the plan's shapes was preferred
    assert s.items["arguments"] + s.items["outputs"] + s.items["temporaries"] == 12 * 2**30
    # Same program and devices at other shapes: the analytic items at the plan's shapes, plus
    # what the compiler added over the analytic sum at the record's shapes (by hand below).
    s = gpu_memory.memory_per_device(TINY, "sampler", **kw, tp=2, batch=8, context_len=100)
    assert s.source.startswith("analytic, calibrated by a compiled record") and "2048" in s.source
    there = gpu_memory.sampler_memory(
        TINY, tp=2, batch=64, context_len=2048, weight_dtype="bfloat16", head_dtype="bfloat16"
    )
    excess = 12 * 2**30 - (sum(there.values()) - there["staged next version"])
    assert s.items["compiler's excess over analytic"] == excess
    here = gpu_memory.sampler_memory(TINY, tp=2, batch=8, context_len=100)
    assert s.total == sum(here.values()) + excess
    assert gpu_memory.sampler_overhead(TINY, records[:1], model="tiny", gpu="h100", tp=2) == excess
    # No record for that device count, model or gpu: analytic.
    assert gpu_memory.memory_per_device(TINY, "sampler", **kw, tp=1, batch=6, context_len=100)
    for other in (dict(kw, model="qwen2.5-7b"), dict(kw, gpu="h200")):
        m = gpu_memory.memory_per_device(TINY, "sampler", **other, tp=2, batch=6, context_len=100)
        assert m.source == "analytic"
    t = gpu_memory.memory_per_device(TINY, "trainer", **kw, fsdp=8, rows=8, seq_len=1024)
    assert t.source.startswith("compiled") and t.total == 12 * 2**30


def test_compiled_file_missing_or_malformed(tmp_path):
    assert gpu_memory.load_compiled(tmp_path / "absent.json") == []
    with pytest.raises(util.PlanError, match="not a compile record file"):
        gpu_memory.load_compiled(_compile_file(tmp_path, [], fmt="something/1"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(util.PlanError, match="not valid JSON"):
        gpu_memory.load_compiled(tmp_path / "bad.json")


def test_predicted_profile_feeds_the_layout_search():
    cfg = known_config("qwen2.5-1.5b", param_dtype="float32", compute_dtype="bfloat16", remat=True)
    prof = gpu_profile.predicted_profile(
        cfg, H100, context_len=700, kv_context_len=2048, train_seq_len=2048, trainer_devices=8
    )
    assert prof["predicted"] and prof["source"].startswith("roofline: h100 peaks")
    dec, train = prof["decode"], prof["train"]
    assert dec["predicted"] and train["predicted"] and dec["kv_max_batch"] > 64
    assert dec["batch_sizes"][-1] == int(dec["kv_max_batch"])  # the curve reaches the KV bound
    assert all(b in ("compute", "memory") for b in dec["bound"])
    assert dec["bound"][0] == "memory"  # one sequence reads all the weights for 2 B flops each
    # Step time grows with batch and per-device rate too (the weights' read is shared).
    assert dec["latency_s"] == sorted(dec["latency_s"])
    curve = util.decode_curve_from_profile(prof)
    assert list(curve.values) == sorted(curve.values)
    device = layout.DeviceProfile.from_measurements(
        decode_batch_sizes=dec["batch_sizes"],
        decode_latency_s=dec["latency_s"],
        train_tokens_per_s_per_device=train["tokens_per_s_per_device"],
        max_gen_batch=dec["kv_max_batch"],
    )
    work = layout.Workload(16, 32, model.LengthDistribution.uniform(2048), max_lag=8)
    plan = layout.plan_layout(device, work)
    assert 1 <= plan.gen_devices <= 15 and plan.gen_batch <= dec["kv_max_batch"]
    assert plan.r > 0 and plan.lag <= 8


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.plan", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


PAPER_7B = [
    "--gpu=h100",
    "--model=qwen2.5-7b",
    f"--devices={paper.N}",
    f"--batch={paper.B}",
    f"--max_len={paper.MAX_LEN}",
    "--max_lag=132",  # the case study's g_max
]


def test_cli_qwen7b_on_128_h100(tmp_path):
    compiled = _compile_file(tmp_path, [])  # no records: the analytic figures, whatever exists
    r = _cli(*PAPER_7B, "--sampler_tp=4", f"--compiled={compiled}", f"--out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "sampler: fits in 80 GB: yes" in out and "trainer: fits in 80 GB: yes" in out
    assert "decode step, predicted (roofline)" in out and "train step, predicted (roofline)" in out
    assert "profile: predicted (roofline), roofline: h100 peaks" in out
    assert "speedup over Conventional" in out
    assert "bundled sample profile" not in r.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert 1 <= plan["gen_devices"] <= 127 and plan["lag"] <= 132
    assert plan["unit"] == "tokens/s" and plan["r"] > 0
    # With a compiled decode record for the same model and tp, the sampler line says so.
    shapes = {"batch": 64, "context_len": 2048, "chunk_steps": 16}
    rec = _record("decode_chunk", 4, shapes, model_name="qwen2.5-7b")
    compiled = _compile_file(tmp_path, [rec])
    r = _cli(*PAPER_7B, "--sampler_tp=4", f"--compiled={compiled}", f"--out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("sampler:")]
    assert "calibrated by a compiled record" in line and "decode_chunk at batch 64" in line


def test_cli_sampler_that_cannot_hold_its_weights_names_the_knob(tmp_path):
    big = {  # a ~33B dense model: two bf16 copies do not fit beside any KV on one H100
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 8192,
        "intermediate_size": 22016,
        "num_hidden_layers": 48,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(big))
    r = _cli("--gpu=h100", f"--model={tmp_path}", "--devices=64", "--max_len=4096", "--max_lag=4")
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert "--sampler_tp=1" in err[0] and "raise --sampler_tp" in err[0]


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--gpu=a100", "--model=qwen2.5-7b"], "--gpu=a100: unknown GPU"),
        (["--gpu=h100", "--model=qwen9-1t"], "--model=qwen9-1t: neither a known model"),
        (["--gpu=h100"], "--gpu needs --model"),
        (["--gpu=h100", "--model=qwen2.5-7b", "--max_len=40000"], "max_position_embeddings"),
        (["--gpu=h100", "--model=qwen2.5-7b", "--sampler_tp=8"], "--sampler_tp=8"),
        (["--gpu=h100", "--model=qwen2.5-7b", "--context_len=100"], "--context_len >= 1024"),
        (["--gpu=h100", "--model=qwen2.5-7b", "--compiled=/nonexistent.json"], "no such file"),
        (
            ["--gpu=h100", "--model=qwen2.5-7b", "--devices=4", "--gen_devices=3"],
            "the trainer does not fit",
        ),
    ],
)
def test_cli_bad_gpu_requests_exit_2_with_one_line(args, expect):
    r = _cli(*args, "--max_lag=8")
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and expect in err[0], r.stderr
    assert "Traceback" not in r.stderr
