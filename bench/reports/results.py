"""Where results live and how a row names its machine: loading a result, the other machine
kinds' copies of it (bench/results/by_machine), the load it ran under, the CPU label."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"  # read at call time: tests point it elsewhere
GiB = 2**30
REAL = "SmolLM2-135M, configs/smollm2_math.py"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def other_machines(name: str, newest: dict) -> list[dict]:
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


def load_avg(d: dict) -> str:
    load = d.get("load") or d.get("load_before") or {}
    load = load.get("start", load)  # plan_validation records the load per phase
    return f"{load['loadavg_1m']:.1f}" if "loadavg_1m" in load else "?"


def machine(d: dict) -> str:
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
