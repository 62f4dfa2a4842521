"""Where a compiled program's time goes on XLA:CPU: its ops' times from a JAX profiler trace.

    path = xla_trace.capture(lambda: jax.block_until_ready(f(x)), "/tmp/trace")
    rows = xla_trace.op_kinds(xla_trace.op_events(path), per=steps)

XLA:CPU's thunk runtime records every op it executes (a YNNPACK fusion, a loop fusion, a
scatter, a copy) as a trace event naming its HLO module and op. Op names are numbered per
module (`ynn_fusion.11`, `copy_bitcast_fusion.40`), and the same name in two modules is two
ops, so events are keyed by (module, op). Summing an op kind's events gives its thread time:
ops on both cores run at once, so a program's thread time can exceed its wall time, and an op
alone on one core while the other idles shows as a gap only `timeline` makes visible.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path


def capture(fn: Callable[[], object], log_dir: Path | str) -> Path:
    """Runs fn() under the JAX profiler; the trace file (trace.json.gz) it wrote."""
    import jax

    log_dir = Path(log_dir)
    before = set(log_dir.rglob("*.trace.json.gz"))
    with jax.profiler.trace(str(log_dir)):
        fn()
    written = sorted(set(log_dir.rglob("*.trace.json.gz")) - before)
    if not written:
        raise RuntimeError(f"the profiler wrote no *.trace.json.gz under {log_dir}")
    return written[-1]


def op_events(trace_path: Path | str) -> list[dict]:
    """The executed ops: dicts of module, op, kind (the op name without its number), thread,
    start and duration in microseconds, in start order."""
    with gzip.open(trace_path) as f:
        trace = json.load(f)
    out = []
    for e in trace.get("traceEvents", []):
        module = e.get("args", {}).get("hlo_module")
        if e.get("ph") != "X" or module is None or e["name"].startswith("end:"):
            continue
        out.append(
            dict(
                module=module,
                op=e["name"],
                kind=re.sub(r"\.\d+$", "", e["name"]),
                thread=e["tid"],
                start_us=float(e["ts"]),
                dur_us=float(e["dur"]),
            )
        )
    return sorted(out, key=lambda e: e["start_us"])


def op_kinds(events: list[dict], *, per: float = 1.0) -> list[dict]:
    """Thread time per (module, op kind), largest first: ms (divided by `per`, e.g. the decode
    steps the trace ran), count (also per `per`), and the share of all ops' thread time."""
    ms, count = collections.Counter(), collections.Counter()
    for e in events:
        key = (e["module"], e["kind"])
        ms[key] += e["dur_us"] / 1e3
        count[key] += 1
    total = sum(ms.values()) or 1.0
    return [
        dict(module=m, kind=k, ms=v / per, count=count[(m, k)] / per, share=v / total)
        for (m, k), v in ms.most_common()
    ]


def busy_threads(events: list[dict], module: str) -> dict:
    """Over the span of `module`'s ops: wall ms, thread ms, and their ratio (how many cores
    were busy on average; 2.0 on two cores is every op overlapping another)."""
    mine = [e for e in events if e["module"] == module]
    if not mine:
        return dict(wall_ms=0.0, thread_ms=0.0, busy_threads=0.0)
    # Wall: the union of the ops' intervals (gaps between executions are not the program's).
    spans = sorted((e["start_us"], e["start_us"] + e["dur_us"]) for e in mine)
    wall, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            wall, lo = wall + hi - lo, a
        hi = max(hi, b)
    wall += hi - lo
    thread = sum(e["dur_us"] for e in mine)
    return dict(wall_ms=wall / 1e3, thread_ms=thread / 1e3, busy_threads=thread / wall)


def timeline(events: list[dict], start_us: float, span_us: float) -> list[str]:
    """Lines `t_ms +dur_ms T<thread> op` for the ops starting in [start_us, start_us + span_us):
    which ops ran alone and which overlapped."""
    window = [e for e in events if start_us <= e["start_us"] < start_us + span_us]
    threads = sorted({e["thread"] for e in window})
    return [
        f"{(e['start_us'] - start_us) / 1e3:8.3f} +{e['dur_us'] / 1e3:6.3f} "
        f"T{threads.index(e['thread'])} {e['op']}"
        for e in window
    ]


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) (\w[\w-]*)\(.*?metadata=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_labels(dump_dir: Path | str, module: str) -> dict[str, str]:
    """op name -> "shape  where" for `module`'s ops, from XLA's optimized HLO text (run with
    XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text). `where` is the op's JAX source path
    (named calls included) without the jit(...) prefix: e.g. a `ynn_fusion.11` is the LM
    head's dot or an attention product. A module compiled several times (one decode chunk per
    window) numbers its ops alike; the first compile found names them."""
    labels: dict[str, str] = {}
    for path in sorted(Path(dump_dir).glob(f"*.{module}.cpu_after_optimizations.txt")):
        for line in path.read_text().splitlines():
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            name, shape, _opcode, metadata = m.groups()
            op_name = _OP_NAME.search(metadata)
            where = op_name[1] if op_name else ""
            where = "/".join(p for p in where.split("/") if not p.startswith("jit("))
            labels.setdefault(name, f"{shape.split('{')[0]}  {where}")
    return labels
