"""Shared helpers for benchmarks: idle check, timing medians, matmul peak, JSON results.

Every benchmark in bench/ compares against a named peer in the same run, reports medians and
ratios, records the machine load before timing (other processes distorted timings here by up
to 7x), and writes one JSON file under bench/results/.
"""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Where `make real-model` puts SmolLM2-135M-Instruct (the real-model benches' default).
REAL_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"

# The one model shape every benchmark of the project uses (57.9M params, untied head).
BENCH_MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    tie_word_embeddings=False,
)

# SmolLM2-135M's shapes (30 layers, tied head), for benchmarks that need no real weights.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
)


def bench_model_config(quick: bool = False, compute_dtype: str = "float32"):
    """BENCH_MODEL as a Llama ModelConfig; `quick`: a tiny shape for checks that things run."""
    from pipelinerl_jax.models.config import ModelConfig

    shape = dict(BENCH_MODEL)
    if quick:
        shape.update(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
        )
    return ModelConfig(
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=2048,
        attention_bias=False,
        qk_norm=False,
        compute_dtype=compute_dtype,
        **shape,
    )


def require_model(model_dir) -> Path:
    """model_dir as a Path if it holds an HF model (its config.json); otherwise one line on
    stderr saying how to get one, and exit code 2 (bad input), before anything is timed."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"error: no model at {model_dir}: run `make real-model` first", file=sys.stderr)
        raise SystemExit(2)
    return model_dir


# --- bad input: one line on stderr and exit code 2, before any work ----------------------


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with its own errors (an unknown flag, a value of the wrong type) as
    one line and exit code 2, as refuse() gives ours (argparse prints its usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} ({self.prog} --help lists the flags)\n")


def refuse(message: str) -> NoReturn:
    """Bad input: `message` as one line on stderr (what is wrong and how to fix it), and exit
    code 2. Benches call this (through the checks below) before anything is set up or timed."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def at_least(value, flag: str, minimum: int = 1):
    """`value` of `flag` if it is >= minimum; otherwise refused (a repeat count of 0 times
    nothing, and a median of nothing is an error only after the setup)."""
    if value is not None and value < minimum:
        refuse(f"{flag}={value}: give {minimum} or more")
    return value


def number_list(text: str, flag: str, *, kind=int, minimum=None, example: str = "1,8") -> list:
    """A comma-separated flag's numbers (`kind` int or float), each >= minimum when given, no
    value twice; otherwise refused, with a valid example."""
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or (minimum is not None and min(values) < minimum):
        bound = "" if minimum is None else f" (each {minimum} or more)"
        refuse(f"{flag}={text}: give a comma-separated list like {example}{bound}")
    if len(set(values)) < len(values):
        refuse(f"{flag}={text}: a value appears twice; give each once")
    return values


def names_list(text: str, flag: str, allowed) -> list[str]:
    """A comma-separated flag's names, each one of `allowed`, none twice; otherwise refused."""
    names = text.split(",")
    unknown = [n for n in names if n not in allowed]
    if unknown or len(set(names)) < len(names):
        why = f"unknown {unknown}" if unknown else "a name appears twice"
        refuse(f"{flag}={text}: {why}; use a comma list of {', '.join(allowed)}")
    return names


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def quick_alone(args, parser, names) -> None:
    """--quick sets its own sizes: any of the flags `names` given beside it with a value other
    than its default would be ignored, so it is refused."""
    if getattr(args, "quick", False):
        given = [f"--{n}" for n in names if getattr(args, n) != parser.get_default(n)]
        if given:
            refuse(f"--quick sets its own sizes: leave out {', '.join(given)}")


def result_name(name: str, flag: str = "--name") -> str:
    """`name` if it makes a plain file name in bench/results (write_result's <name>.json);
    otherwise refused, before the work whose result it would name (not after: lost)."""
    if not _PLAIN_NAME.fullmatch(name):
        refuse(
            f"{flag}={name!r}: use letters, digits, '_', '-' and '.' (not first): it names "
            "a file in bench/results"
        )
    return name


def output_file(path: str, flag: str = "--out") -> Path:
    """`path` if a file can be written there (not a directory; its folder exists or can be
    made: made now); otherwise refused, before the work whose output it would hold."""
    out = Path(path)
    if out.is_dir():
        refuse(f"{flag}={path}: is a directory; give a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        refuse(f"{flag}={path}: cannot make its folder ({e.strerror}); give a writable path")
    if not os.access(out.parent, os.W_OK | os.X_OK) or (
        out.exists() and not os.access(out, os.W_OK)
    ):
        refuse(f"{flag}={path}: not writable; give a writable path")
    return out


def check_launch_config(config: str | None, sets=(), *, steps: int | None = None):
    """The RunConfig that `launch.py --config=<config> --config.<set> ...`, run from the
    repository root as the benches run it, would run (config None: launch.py's default),
    built as launch.py builds it; a bad config file or override is refused in launch.py's own
    one line ("config error: ..."), exit code 2, before any run starts (a bench would
    otherwise time some runs before one of them refused it)."""
    from pipelinerl_jax import config_cli
    from pipelinerl_jax.errors import ConfigError

    flags = [f"--config.{s}" for s in sets]
    if steps is not None:
        flags.append(f"--config.steps={steps}")
    root = Path(__file__).resolve().parents[1]
    path = str(root / (config or "configs/default.py"))  # an absolute config stays as it is
    try:
        rest, overrides = config_cli.split_argv(flags)
        if rest:
            raise ConfigError(f"--set={rest[0]}: give FIELD=VALUE")
        return config_cli.load_run_config(path, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run_launch(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, **kwargs) for a launch.py run; when it fails, exits with its code,
    adding nothing after the line the run printed itself (a config error: exit code 2)."""
    proc = subprocess.run(cmd, **kwargs)
    if proc.returncode:
        if proc.returncode != 2:  # a run that failed, not one refused: say which
            print(f"error: launch.py exited {proc.returncode}", file=sys.stderr)
        raise SystemExit(proc.returncode)
    return proc


def load_average() -> dict:
    """1-minute load average and core count: a busy machine makes timings meaningless."""
    one, five, _ = os.getloadavg()
    return {"loadavg_1m": one, "loadavg_5m": five, "cpus": os.cpu_count()}


def warn_if_busy(threshold: float = 0.5) -> dict:
    """Returns the load record; prints a warning when other work is running."""
    load = load_average()
    if load["loadavg_1m"] > threshold:
        print(
            f"WARNING: machine not idle (1-min load {load['loadavg_1m']:.2f}); "
            "timings may be distorted"
        )
    return load


def median_time(fn, *, repeats: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of fn() in seconds, and every time; fn must block until ready."""
    from pipelinerl_jax.plan.measure import call_times

    times = call_times(fn, repeats=repeats, warmup=warmup)
    return statistics.median(times), times


def alternating_medians(fns: dict, *, repeats: int = 5, warmup: int = 1) -> dict:
    """{name: (median seconds, every time)} for each fn() of `fns`, timed in alternating rounds.

    Every round runs each fn in turn (ours, peer, ours, peer, ...): `warmup` untimed calls of
    it, then one timed call. Why alternate: this machine is a shared VM whose speed drifts
    (both engines measured ~15% faster one day than the day before), and timing all of one
    engine's repeats before the other's puts such drift into their ratio. Why warm up before
    every timed call: the first call after switching runs slow. torch's OpenMP workers keep
    spinning after a torch call, so an XLA call right after one shares the two cores with them
    (a 166 MB f32 matrix-vector product read 30-34 GB/s alone, 20-23 GB/s right after a torch
    one), and pausing instead of warming up made both sides slower still (15 GB/s after a
    0.2 s sleep: the cores had gone idle). Each fn must block until its work is done.
    """
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(warmup):
                fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), t) for name, t in times.items()}


def f32_matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """This machine's large f32 matmul rate through XLA (GFLOP/s): the roofline we report against."""
    import jax
    import jax.numpy as jnp

    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), jnp.float32)
    b = jax.random.normal(key_b, (n, n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    med, _ = median_time(lambda: mm(a, b).block_until_ready(), repeats=repeats)
    return 2 * n**3 / med / 1e9


def cpu_features() -> dict:
    """CPU model and the vector / matrix units that decide XLA's and torch's matmul paths."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            "unknown",
        )
        if os.path.exists("/proc/cpuinfo")
        else "unknown"
    )
    return {
        "model": model,
        **{f: f in flags for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")},
    }


def machine_kind(cpu: dict) -> str:
    """A file-name-safe CPU kind ("xeon", "epyc", ...): which of the machines made a figure."""
    model = str(cpu.get("model", "unknown")).lower()
    for kind in ("xeon", "epyc"):
        if kind in model:
            return kind
    return "".join(ch if ch.isalnum() else "-" for ch in model)[:40] or "unknown"


def write_result(name: str, payload: dict) -> Path:
    """Writes bench/results/<name>.json with machine facts attached, and the same file as
    bench/results/by_machine/<name>.<kind>.json, so the newest figure of each machine kind
    stays (bench/report.py shows every kind's); returns the main path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = dict(payload)
    payload.setdefault(
        "machine",
        {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "processor": platform.processor(),
        },
    )
    payload.setdefault("cpu", cpu_features())
    payload.setdefault("command", " ".join(["python", *sys.argv]))
    payload.setdefault("date", datetime.datetime.now(datetime.UTC).isoformat())
    path = RESULTS_DIR / f"{name}.json"
    text = json.dumps(payload, indent=2, default=_jsonable)
    by_machine = RESULTS_DIR / "by_machine" / f"{name}.{machine_kind(payload['cpu'])}.json"
    by_machine.parent.mkdir(exist_ok=True)
    for target in (path, by_machine):
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(text)
        tmp.replace(target)
    print(f"wrote {path} and {by_machine.relative_to(RESULTS_DIR)}")
    return path


# --- a launched run, seen from outside (bench_elastic.py and its test) -------------------


def train_records(workdir: Path) -> list[dict]:
    """The train records of a run's metrics.jsonl so far ([] before its first)."""
    from pipelinerl_jax.pipeline.metrics import METRICS_FILE, read_records

    return [r for r in read_records(Path(workdir) / METRICS_FILE) if r.get("kind") == "train"]


def command_of(workdir: Path, process_id: int) -> tuple[int, list[str]]:
    """The pid and command line (from /proc) of process `process_id` of the run in `workdir`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        argv = [a.decode() for a in argv]
        if f"--workdir={workdir}" in argv and f"--process_id={process_id}" in argv:
            if "launch.py" in Path(argv[1]).name:  # the process itself, not its launcher
                return int(pid), argv
    raise AssertionError(f"no process {process_id} of the run found")


def _jsonable(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Prints rows as a fixed-width table (the same rows go to JSON and README)."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)
