"""bench/xla_trace.py: ops' times from a real JAX profiler trace, and their HLO labels."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import xla_trace  # noqa: E402


def test_a_traced_program_lists_its_ops_by_module_and_kind(tmp_path):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((512, 256), np.float32))
    x = jnp.asarray(rng.standard_normal((256, 64), np.float32))

    @jax.jit
    def traced_matmuls(w, x):
        return jnp.tanh(w @ x).sum(0) + jnp.exp(w[:, :64] @ x[:64]).max(0)

    traced_matmuls(w, x).block_until_ready()  # compiled outside the trace
    path = xla_trace.capture(lambda: traced_matmuls(w, x).block_until_ready(), tmp_path)
    events = xla_trace.op_events(path)
    mine = [e for e in events if e["module"] == "jit_traced_matmuls"]
    assert mine, sorted({e["module"] for e in events})
    assert all(e["dur_us"] >= 0 and not e["kind"][-1].isdigit() for e in mine)
    assert [e["start_us"] for e in events] == sorted(e["start_us"] for e in events)

    kinds = xla_trace.op_kinds(mine, per=2.0)
    assert sum(k["share"] for k in kinds) == pytest.approx(1.0)
    assert [k["ms"] for k in kinds] == sorted((k["ms"] for k in kinds), reverse=True)
    assert sum(k["count"] for k in kinds) == pytest.approx(len(mine) / 2)

    busy = xla_trace.busy_threads(events, "jit_traced_matmuls")
    assert 0 < busy["wall_ms"] <= busy["thread_ms"] + 1e-9
    assert busy["busy_threads"] >= 1.0 - 1e-9
    assert xla_trace.busy_threads(events, "no such module")["wall_ms"] == 0.0

    lines = xla_trace.timeline(events, mine[0]["start_us"], 1e9)
    assert lines[0].split()[0] == "0.000" and any(e["op"] in lines[0] for e in mine)


def test_busy_threads_counts_overlap_once():
    events = [
        dict(module="m", op="a", kind="a", thread=1, start_us=0.0, dur_us=10.0),
        dict(module="m", op="b", kind="b", thread=2, start_us=5.0, dur_us=10.0),  # overlaps a
        dict(module="m", op="c", kind="c", thread=1, start_us=100.0, dur_us=5.0),  # after a gap
    ]
    busy = xla_trace.busy_threads(events, "m")
    assert busy["wall_ms"] == pytest.approx(0.020)  # [0, 15) and [100, 105)
    assert busy["thread_ms"] == pytest.approx(0.025)


def test_hlo_labels_name_each_op_by_shape_and_source(tmp_path):
    (tmp_path / "module_0007.jit__decode_chunk.cpu_after_optimizations.txt").write_text(
        "HloModule jit__decode_chunk\n"
        "%fused_computation (p: f32[4]) -> f32[4] {\n"
        "  ROOT %x = f32[4]{0} exp(f32[4]{0} %p)\n"
        "}\n"
        "ENTRY %main {\n"
        "  %ynn_fusion.11 = f32[49152,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, "
        'metadata={op_name="jit(_decode_chunk)/while/body/head/dot_general" '
        "stack_frame_id=3}, backend_config={}\n"
        '  ROOT %copy.2 = f32[16]{0} copy(%d), metadata={op_name="jit(_decode_chunk)/copy"}\n'
        "}\n"
    )
    labels = xla_trace.hlo_labels(tmp_path, "jit__decode_chunk")
    assert labels == {
        "ynn_fusion.11": "f32[49152,16]  while/body/head/dot_general",
        "copy.2": "f32[16]  copy",
    }
    assert xla_trace.hlo_labels(tmp_path, "jit__prefill") == {}


def test_profile_decode_refuses_a_bad_count_in_one_line(capsys):
    from bench import profile_decode

    assert profile_decode.main(["--batch=0", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch" in err[0]
