"""Publishing weights to a sampler in another process, against the in-process copy it replaces.

    .venv/bin/python bench/bench_weight_transfer.py          # ~3 min; the machine must be idle
    .venv/bin/python bench/bench_weight_transfer.py --quick  # tiny shapes: checks that it runs

Two localhost processes under jax.distributed: process 0 publishes a model's params with
`distributed.weight_server.WeightServer`, process 1 pulls every version with a `WeightClient` (the
background thread, as a sampler runs it). The peer is what a single-process run does instead:
`jax.device_put(params, may_alias=False)`, the copy the in-process Publisher makes
(pipeline/weights.py), timed in this process with nothing else running.

Models: the bench model (bench/common.py BENCH_MODEL, 57.9M params) and SmolLM2-135M's shapes
(30 layers, hidden 576, intermediate 1536, 9 heads / 3 kv heads of 64, vocab 49152, tied),
both f32 with random values (the bytes moved do not depend on them); and SmolLM2's LoRA
publish, rank-16 adapters on every projection (a LoRA run publishes those alone). For the
SmolLM2 rows also `sampler_prepare`: the in-process publish as a run makes it
(PagedSampler.prepare: the private copy and the conversion to the decode layout). Transfer chunk sizes:
4 MiB (this project's default) and jax's default 256 MiB. Per version:

- pull: from the claim granted to the bytes landed on the client (WeightClient.stats);
- publish->ack: from `publish()` to the server seeing the client's ack (the device copy, the
  announcement, the claim round trip through the key-value store, the pull and the ack);
- publish call: how long `publish()` held the trainer thread.

Medians over `--repeats` versions after one warm-up version. What this measures on a 2-core VM:
both processes share the two cores and the bytes go through the loopback device, so the
figures are this stack's overheads (socket copies, chunking, Python threads), not what a
network between hosts does. Writes bench/results/weight_transfer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

MIB = 1 << 20
TRANSFER_SIZES = {"4MiB": 4 * MIB, "default_256MiB": 256 * MIB}
SMOLLM2_135M = common.SMOLLM2_135M
LORA = {"rank": 16, "alpha": 32.0}  # every projection: lora.TARGETS
CHILD_TIMEOUT_S = 240
PREFIX = "bench/weights"


def model_config(name: str):
    """The ModelConfig of `name` ("bench", "smollm2_135m", "smollm2_135m_lora" or "quick"),
    f32 params; "_lora": rank-16 adapters on all seven projections (what a LoRA run trains)."""
    import dataclasses

    if name in ("bench", "quick"):
        return common.bench_model_config(quick=name == "quick")
    cfg = dataclasses.replace(common.bench_model_config(), **SMOLLM2_135M)
    return dataclasses.replace(cfg, lora=LORA) if name.endswith("_lora") else cfg


def params_of(name: str):
    """What a publish of `name` moves: the whole model, or with LoRA the adapters alone."""
    import jax

    from pipelinerl_jax.models import decoder, lora

    _, params = decoder.init(model_config(name), jax.random.key(0))
    if name.endswith("_lora"):
        params = lora.split(params)[0]
    return jax.block_until_ready(params)


def sampler_prepare_s(name: str, repeats: int) -> tuple[float, list[float]]:
    """The in-process publish as a run makes it: PagedSampler.prepare (the private copy onto
    the sampler's devices and the conversion to its decode layout) of what `params_of` gives."""
    import jax

    from pipelinerl_jax.models import decoder
    from pipelinerl_jax.sampler.config import SamplerConfig
    from pipelinerl_jax.sampler.sampler import PagedSampler

    graphdef, full = decoder.init(model_config(name), jax.random.key(0))
    sampler = PagedSampler(graphdef, full, SamplerConfig(num_slots=16, max_seq_len=288))
    params = params_of(name)
    return common.median_time(
        lambda: jax.block_until_ready(sampler.prepare(params)), repeats=repeats, warmup=1
    )


def nbytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# --- the two processes ----------------------------------------------------------------------


def run_server(args) -> dict:
    from pipelinerl_jax.distributed.channel import kv_client
    from pipelinerl_jax.distributed.weight_server import WeightServer

    params = params_of(args.model)
    server = WeightServer([1], transfer_size=args.transfer_size, prefix=PREFIX)
    publish_s, e2e_s = [], []
    for version in range(1, args.repeats + 2):  # version 1 warms up
        t0 = time.perf_counter()
        server.publish(params, version)
        t_publish = time.perf_counter() - t0
        if not server.wait_idle(CHILD_TIMEOUT_S):
            raise RuntimeError(f"version {version} was not acked within {CHILD_TIMEOUT_S} s")
        if version > 1:
            publish_s.append(t_publish)
            e2e_s.append(time.perf_counter() - t0)
    kv_client().blocking_key_value_get("bench/client_done", CHILD_TIMEOUT_S * 1000)
    server.close()
    return {"bytes": nbytes(params), "publish_s": publish_s, "publish_to_ack_s": e2e_s}


def run_client(args) -> dict:
    from pipelinerl_jax.distributed.channel import kv_client
    from pipelinerl_jax.distributed.weight_client import WeightClient
    from pipelinerl_jax.models import decoder, lora

    _, like = decoder.abstract_init(model_config(args.model))
    if args.model.endswith("_lora"):  # the adapters alone travel (a LoRA run's sampler)
        like = lora.split(like)[0]
    client = WeightClient(like, transfer_size=args.transfer_size, prefix=PREFIX)
    pull_s, seen = [], 0.0
    while client.version < args.repeats + 1:
        got = client.wait(CHILD_TIMEOUT_S)
        if got is None:
            raise RuntimeError(f"no new version within {CHILD_TIMEOUT_S} s")
        del got  # the sampler would swap it in; here only the transfer counts
        # The thread pulls the next version only after poll() took this one: one pull per delta.
        pull_s.append(client.stats["pull_s"] - seen)
        seen = client.stats["pull_s"]
    client.close()
    kv_client().key_value_set("bench/client_done", "1")
    return {"pull_s": pull_s[1:]}


def child_main(args) -> None:
    import jax

    from pipelinerl_jax.distributed import runtime

    spec = runtime.ProcessSpec(args.coordinator, num_processes=2, process_id=args.process)
    runtime.initialize(spec, heartbeat_s=10, init_timeout_s=60, shutdown_timeout_s=30)
    result = run_server(args) if args.process == 0 else run_client(args)
    Path(args.out).write_text(json.dumps(result))
    jax.distributed.shutdown()


# --- the orchestrating process --------------------------------------------------------------


def run_pair(model: str, transfer_size: int, repeats: int, tmp: Path) -> dict:
    """Runs one server and one client process; returns both results."""
    from pipelinerl_jax.distributed import runtime

    coordinator = f"127.0.0.1:{runtime.free_port()}"
    children = []
    try:
        for process in (0, 1):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                f"--process={process}",
                f"--coordinator={coordinator}",
                f"--model={model}",
                f"--transfer_size={transfer_size}",
                f"--repeats={repeats}",
                f"--out={tmp / f'{process}.json'}",
            ]
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            children.append(subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True))
        for child in children:
            child.wait(timeout=CHILD_TIMEOUT_S)
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    codes = [c.returncode for c in children]
    if codes != [0, 0]:
        raise SystemExit(f"{model}, transfer_size {transfer_size}: children exited {codes}")
    server = json.loads((tmp / "0.json").read_text())
    client = json.loads((tmp / "1.json").read_text())
    return {**server, **client}


def device_put_copy_s(model: str, repeats: int) -> tuple[int, float, list[float]]:
    """The single-process peer: bytes, median and every time of a private device copy."""
    import jax

    params = params_of(model)
    leaves = jax.tree.leaves(params)
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def copy():
        jax.block_until_ready(jax.device_put(leaves, sharding, may_alias=False))

    med, times = common.median_time(copy, repeats=repeats, warmup=1)
    return nbytes(params), med, times


def main() -> int:
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--transfer_size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    common.at_least(args.repeats, "--repeats")
    if args.child:
        child_main(args)
        return 0

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    load = common.warn_if_busy()
    models = ["quick"] if args.quick else ["bench", "smollm2_135m", "smollm2_135m_lora"]
    sizes = {"4MiB": 4 * MIB} if args.quick else TRANSFER_SIZES
    repeats = 2 if args.quick else args.repeats
    rows = []
    for model in models:
        size_bytes, copy_med, copy_times = device_put_copy_s(model, repeats)
        prepare_med, prepare_times = (
            sampler_prepare_s(model, repeats) if model.startswith("smollm2") else (None, [])
        )
        mb = size_bytes / 1e6
        for label, transfer_size in sizes.items():
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                r = run_pair(model, transfer_size, repeats, Path(tmp))
            pull = statistics.median(r["pull_s"])
            e2e = statistics.median(r["publish_to_ack_s"])
            row = {
                "model": model,
                "params_mb": round(mb, 1),
                "transfer_size": label,
                "pull_mb_s": mb / pull,
                "publish_to_ack_mb_s": mb / e2e,
                "device_put_mb_s": mb / copy_med,
                "pull_vs_device_put": copy_med / pull,
                "publish_call_ms": 1e3 * statistics.median(r["publish_s"]),
                "bytes": size_bytes,
                "publish_to_ack_ms": 1e3 * e2e,
                "sampler_prepare_ms": None if prepare_med is None else 1e3 * prepare_med,
                "sampler_prepare_s": prepare_times,
                "pull_s": r["pull_s"],
                "publish_to_ack_s": r["publish_to_ack_s"],
                "device_put_s": copy_times,
                "pair_wall_s": time.perf_counter() - t0,
            }
            rows.append(row)
            print(
                f"{model:13s} {label:15s} pull {row['pull_mb_s']:7.0f} MB/s  publish->ack "
                f"{row['publish_to_ack_mb_s']:7.0f} MB/s  device_put {row['device_put_mb_s']:7.0f}"
                f" MB/s  publish() {row['publish_call_ms']:.2f} ms",
                flush=True,
            )
    columns = ["model", "transfer_size", "pull_mb_s", "publish_to_ack_mb_s", "device_put_mb_s"]
    common.print_table(
        rows, columns + ["publish_call_ms", "publish_to_ack_ms", "sampler_prepare_ms"]
    )
    common.write_result(
        "weight_transfer_quick" if args.quick else "weight_transfer",
        {
            "config": {
                "quick": args.quick,
                "repeats": repeats,
                "models": {"bench": common.BENCH_MODEL, "smollm2_135m": SMOLLM2_135M},
                "lora": LORA,
                "param_dtype": "float32",
                "transport": "jax.experimental.transfer over 127.0.0.1, 2 processes",
            },
            "note": (
                "2-core VM, both processes and the loopback device on the same two cores: "
                "these are the stack's overheads (socket copies, chunking, threads), not what "
                "a network between hosts does; device_put is the single-process peer (a "
                "private copy on the same device)"
            ),
            "rows": rows,
            "load_before": load,
            "load_after": common.load_average(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
