"""Layout planner CLI: how many devices should generate, how many train, at what batch.

  python -m pipelinerl_jax.plan --devices=128 --batch=128 --max_lag=8 --profile=FILE
  python -m pipelinerl_jax.plan --reproduce_paper            # Appendix A.4, figures 7 and 8
  python -m pipelinerl_jax.plan measure --out=profile.json   # U(h) on this backend
  python -m pipelinerl_jax.plan measure --engine_model=tiny  # + our decode latency, train rate
  python -m pipelinerl_jax.plan --devices=32 --devices_per_host=8 --batch=128 --max_lag=4
  python -m pipelinerl_jax.plan --gpu=h100 --model=qwen2.5-7b --sampler_tp=4 --devices=128 \
      --batch=128 --max_len=8192 --max_lag=132             # predicted (roofline) on H100s

Prints the recommended split (PipelineRL vs Conventional RL at the same lag) and writes
utilisation.png and throughput_vs_lag.png to --out_dir. Units follow the profile: with a 'decode'
section and a training rate the plan is in tokens/s (the talk's form); with only the matmul U(h)
it is in tokens per flash (the paper's form) and needs tau, flashes per training token.
With --gpu the profile is predicted instead of read: roofline decode and train step times from
the GPU's published peaks and the model's shapes (plan/gpu_plan.py, on roofline.py), plus whether
each role fits in the GPU's memory (analytic, or XLA's compiled figures from --compiled where
they exist).
Bad requests exit with code 2 and a one-line message saying what would work.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import numpy as np
from absl import app, flags

from pipelinerl_jax import cli
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.plan import engine_probe, figures, gpu_plan, layout, measure, model, paper
from pipelinerl_jax.plan import hosts as hosts_lib
from pipelinerl_jax.plan import utilisation as util
from pipelinerl_jax.plan.utilisation import PlanError

SAMPLE_PROFILE = Path(__file__).resolve().parent / "profiles" / "sample.json"

_DEVICES = flags.DEFINE_integer("devices", 128, "Number of accelerators N to split.")
_BATCH = flags.DEFINE_integer("batch", 128, "Sequences per optimizer step B.")
_MAX_LAG = flags.DEFINE_integer("max_lag", None, "Staleness bound in optimizer steps.")
_PROFILE = flags.DEFINE_string("profile", str(SAMPLE_PROFILE), "Profile JSON (plan measure).")
_UNITS = flags.DEFINE_enum(
    "units",
    "auto",
    ["auto", "flash", "seconds"],
    "flash: U(h) and tau; seconds: decode latency and train tokens/s.",
)
_TAU = flags.DEFINE_float("tau", None, "Flash mode: training flashes per token (paper: 128/26.02).")
_TRAIN_TPS = flags.DEFINE_float(
    "train_tokens_per_s", None, "Seconds mode: training tokens/s per device (overrides profile)."
)
_MAX_LEN = flags.DEFINE_integer("max_len", 1024, "Max sequence length L (uniform lengths 1..L).")
_LENGTHS = flags.DEFINE_string(
    "lengths",
    None,
    "JSON/JSONL of observed lengths (overrides "
    "--max_len): a list, {'lengths': [...]}, {'histogram': {len: n}}, "
    "or JSONL lines with 'length' or 'lengths'.",
)
_GEN_DEVICES = flags.DEFINE_integer("gen_devices", None, "Fix the generation device count I.")
_GEN_BATCH = flags.DEFINE_float("gen_batch", None, "Fix the per-device generation batch H.")
_DEVICES_PER_HOST = flags.DEFINE_integer(
    "devices_per_host",
    None,
    "Several hosts: devices per host; generation and training get whole hosts each.",
)
_TRANSFER = flags.DEFINE_float(
    "transfer_gb_per_s",
    None,
    "Several hosts: weight-pull bandwidth from the trainer host, GB/s (default: the "
    "profile's weight_transfer.bytes_per_s; bench/bench_weight_transfer.py measures it).",
)
_PARAM_BYTES = flags.DEFINE_float(
    "param_bytes",
    None,
    "Several hosts: bytes of one weight version (default: the profile's model params x dtype).",
)
_MAX_GEN_BATCH = flags.DEFINE_float(
    "max_gen_batch", None, "KV-cache bound on the per-device batch (overrides profile)."
)
_OUT_DIR = flags.DEFINE_string("out_dir", ".", "Where the PNG figures (and plan.json) go.")
_PLOT_MAX_LAG = flags.DEFINE_integer(
    "plot_max_lag", None, "Right end of the lag figure (default: 2 x max_lag, at least 16)."
)
_REPRODUCE = flags.DEFINE_bool("reproduce_paper", False, "Recompute Appendix A.4 and its figures.")
# measure
_OUT = flags.DEFINE_string("out", "profile.json", "measure: where to write the profile JSON.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", None, "measure: batch sizes h to time.")
_MM_M = flags.DEFINE_integer(
    "matmul_m", None, "measure: m of (m,h)x(h,n); 4096 on GPU, 512 on CPU."
)
_MM_N = flags.DEFINE_integer("matmul_n", None, "measure: n; 16384 on GPU, 2048 on CPU.")
_DTYPE = flags.DEFINE_string("dtype", None, "measure: bfloat16 on GPU, float32 on CPU.")
_MAX_PAD = flags.DEFINE_integer("max_pad", 64, "measure: consider padding h up to h + max_pad.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "measure: timed repeats per size (fastest kept).")
_PEAK = flags.DEFINE_float(
    "peak_tflops", None, "measure: peak TFLOP/s (default: published or measured)."
)
_MATMUL = flags.DEFINE_bool("matmul", True, "measure: run the U(h) matmul recipe.")
_ENGINE_MODEL = flags.DEFINE_string(
    "engine_model",
    None,
    "measure: also time our sampler and "
    "trainer on this model: 'tiny' (built-in) or a Hugging Face "
    "checkpoint directory.",
)
_DECODE_SIZES = flags.DEFINE_list(
    "decode_batch_sizes",
    ["1", "2", "4", "8", "16", "32"],
    "measure: batch sizes for the decode latency.",
)
_CONTEXT = flags.DEFINE_integer(
    "context_len",
    128,
    "measure: context of every decoding sequence; --gpu: KV tokens each sequence reserves "
    "(default --max_len).",
)
_CHUNK = flags.DEFINE_integer("chunk_steps", 8, "measure: decode steps per timed chunk.")
_TRAIN_ROWS = flags.DEFINE_integer("train_rows", 4, "measure: packed rows per train step.")
_TRAIN_SEQ = flags.DEFINE_integer("train_seq_len", 128, "measure: tokens per packed row.")
# --gpu: a predicted profile
_GPU = flags.DEFINE_string(
    "gpu", None, "Predict the profile for this GPU (h100, h200) instead of reading --profile."
)
_MODEL = flags.DEFINE_string(
    "model", None, "--gpu: a known model (models/known_shapes.py) or an HF config.json path."
)
_SAMPLER_TP = flags.DEFINE_integer("sampler_tp", 1, "--gpu: devices per sampler (tensor parallel).")
_COMPILED = flags.DEFINE_string(
    "compiled",
    None,
    "--gpu: compile records (bench/compile_h100.py) whose memory replaces the analytic figures "
    "(default bench/results/<gpu>_compile.json if present).",
)
_KV_GIB = flags.DEFINE_float(
    "kv_memory_gib",
    None,
    "measure: device memory for the KV-cache "
    "bound (default: what the accelerator reports; none on CPU).",
)


def load_lengths(path: str) -> model.LengthDistribution:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise PlanError(f"--lengths={path}: no such file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise PlanError(f"--lengths={path}: neither JSON nor JSONL ({e.msg})") from None
    if isinstance(data, dict) and "histogram" in data:
        return model.LengthDistribution.from_histogram(data["histogram"])
    if isinstance(data, dict) and "lengths" in data:
        return model.LengthDistribution.from_lengths(data["lengths"])
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        lengths = []
        for rec in data:
            lengths.extend(rec.get("lengths", []))
            if "length" in rec:
                lengths.append(rec["length"])
        if not lengths:
            raise PlanError(f"--lengths={path}: no 'length'/'lengths' field in any JSONL record")
        return model.LengthDistribution.from_lengths(lengths)
    if isinstance(data, list):
        return model.LengthDistribution.from_lengths(data)
    raise PlanError(
        f"--lengths={path}: expected a list of lengths, {{'lengths': [...]}} or "
        "{'histogram': {length: count}}"
    )


def device_profile(profile: dict, name: str) -> tuple[layout.DeviceProfile, str]:
    """The DeviceProfile the flags and profile describe, plus a note on where tau came from."""
    units = _UNITS.value
    train = profile.get("train") or {}
    has_train_rate = _TRAIN_TPS.value is not None or "tokens_per_s_per_device" in train
    if units == "auto":
        units = "seconds" if profile.get("decode") and has_train_rate else "flash"
    kv = _MAX_GEN_BATCH.value
    if units == "seconds":
        if not has_train_rate:
            raise PlanError(
                f"{name}: seconds mode needs training tokens/s per device; pass "
                "--train_tokens_per_s or measure the trainer into the profile"
            )
        curve = util.decode_curve_from_profile(profile, name=name)
        tps = _TRAIN_TPS.value or float(train["tokens_per_s_per_device"])
        kv = kv if kv is not None else (profile.get("decode") or {}).get("kv_max_batch")
        return (
            layout.DeviceProfile(curve, 1.0 / tps, kv),
            f"seconds mode: decode latency per batch, training {tps:.4g} tokens/s/device",
        )
    curve = util.utilisation_from_profile(profile, name=name)
    if _TAU.value is not None:
        tau, note = _TAU.value, f"flash mode: tau={_TAU.value:g} flashes/token (--tau)"
    elif "tau_flashes" in train:
        tau = float(train["tau_flashes"])
        note = f"flash mode: tau={tau:.4g} flashes/token (profile)"
    else:
        tau = paper.TAU
        note = (
            f"flash mode: tau={tau:.4g} flashes/token is the paper's H100 value; pass --tau "
            "for yours"
        )
    return layout.DeviceProfile(curve, tau, kv), note


def hosts_from(profile: dict) -> hosts_lib.Hosts | None:
    """The Hosts the flags and profile describe (None: one host, no transfer)."""
    if _DEVICES_PER_HOST.value is None:
        for name in ("transfer_gb_per_s", "param_bytes"):
            if flags.FLAGS[name].present:
                raise PlanError(f"--{name} describes several hosts: give --devices_per_host too")
        return None
    bandwidth = (
        _TRANSFER.value * 1e9
        if _TRANSFER.value is not None
        else (profile.get("weight_transfer") or {}).get("bytes_per_s")
    )
    param_bytes = _PARAM_BYTES.value
    if param_bytes is None:
        described = (profile.get("decode") or {}).get("model") or {}
        if "params" in described:
            itemsize = np.dtype(described.get("dtype", "float32")).itemsize
            param_bytes = float(described["params"]) * itemsize
    return hosts_lib.Hosts(
        _DEVICES_PER_HOST.value,
        param_bytes=param_bytes or 0.0,
        transfer_bytes_per_s=None if bandwidth is None else float(bandwidth),
    )


def profile_warnings(profile: dict, path: str) -> list[str]:
    """Why the profile may not describe the hardware being planned for, one line each.

    The plan is only as good as its profile: decode latency and training rate are measured on
    one device, and the bundled sample was measured on a shared 2-core CPU."""
    warnings = []
    where = (
        f"{profile.get('device_kind', '?')} ({profile.get('backend', '?')}, "
        f"{profile.get('host_cpus', '?')} host CPUs, {profile.get('created', 'undated')})"
    )
    if Path(path).resolve() == SAMPLE_PROFILE:
        warnings.append(
            f"WARNING: planning with the bundled sample profile, measured on {where}, "
            "not on your hardware: run `python -m pipelinerl_jax.plan measure "
            "--engine_model=DIR --out=profile.json` on one of the target devices "
            "and pass --profile=profile.json"
        )
    elif profile.get("backend") == "cpu":
        warnings.append(
            f"WARNING: the profile was measured on {where}; plan with a profile "
            "measured on the accelerators the run will use"
        )
    load = profile.get("loadavg_1m_at_start")
    if load is not None and load > 0.5 and (profile.get("host_cpus") or 0) <= 8:
        warnings.append(
            f"WARNING: the profile was measured at a 1-minute load average of {load} "
            "on a small host: its timings are likely slower than the device's"
        )
    return warnings


# Flags that only shape a --gpu prediction; without --gpu they would be ignored in silence.
_GPU_ONLY = ("model", "sampler_tp", "compiled")


def run_plan() -> None:
    if not _GPU.value:
        given = [f"--{name}" for name in _GPU_ONLY if flags.FLAGS[name].present]
        if given:
            raise PlanError(
                f"{', '.join(given)} only shape(s) a --gpu prediction: add --gpu=h100 (or "
                "h200), or leave them out to plan from --profile's measured rates"
            )
    if _MAX_LAG.value is None:
        raise PlanError(
            "--max_lag is required: the staleness (optimizer steps) your algorithm "
            "tolerates, e.g. --max_lag=8"
        )
    for flag in (_TAU, _TRAIN_TPS):
        if flag.value is not None and not flag.value > 0:
            raise PlanError(f"--{flag.name}={flag.value:g}: must be > 0")
    if _PLOT_MAX_LAG.value is not None and _PLOT_MAX_LAG.value < 1:
        raise PlanError(
            f"--plot_max_lag={_PLOT_MAX_LAG.value}: must be >= 1 (the figure's right end)"
        )
    dist = (
        load_lengths(_LENGTHS.value)
        if _LENGTHS.value
        else model.LengthDistribution.uniform(_MAX_LEN.value)
    )
    if (
        _DEVICES.value is not None
        and _GEN_DEVICES.value is not None
        and _GEN_DEVICES.value >= _DEVICES.value
    ):
        raise PlanError(
            f"--gen_devices={_GEN_DEVICES.value}: only --devices={_DEVICES.value} "
            f"exist and one must train; use --gen_devices <= {_DEVICES.value - 1} or "
            f"raise --devices above {_GEN_DEVICES.value}"
        )
    cli.check_dir(_OUT_DIR.value, create=True, where=f"--out_dir={_OUT_DIR.value}")
    if _GPU.value:
        setup = gpu_plan.setup(
            _GPU.value,
            _MODEL.value,
            dist,
            sampler_tp=_SAMPLER_TP.value,
            context_len=_CONTEXT.value if flags.FLAGS["context_len"].present else None,
            compiled=_COMPILED.value,
            profile_given=flags.FLAGS["profile"].present,
        )
        predicted = gpu_plan.plan_on_gpu(
            setup,
            dist,
            devices=_DEVICES.value,
            batch=_BATCH.value,
            gen_devices=_GEN_DEVICES.value,
            search=lambda profile: _plan(profile, dist, f"--gpu={_GPU.value}"),
        )
        prof, work, plan, note = predicted.searched
        print("\n".join(predicted.lines))
    else:
        profile = util.load_profile(_PROFILE.value)
        prof, work, plan, note = _plan(profile, dist, f"--profile={_PROFILE.value}")
        for line in profile_warnings(profile, _PROFILE.value):
            print(line, file=sys.stderr)
        print(f"profile: {_PROFILE.value}; {note}")
    print(layout.format_plan(plan, work))
    _write_outputs(prof, work, plan)


def _plan(profile: dict, dist: model.LengthDistribution, name: str):
    prof, note = device_profile(profile, name)
    work = layout.Workload(
        _DEVICES.value, _BATCH.value, dist, _MAX_LAG.value, hosts=hosts_from(profile)
    )
    plan = layout.plan_layout(
        prof, work, gen_devices=_GEN_DEVICES.value, gen_batch=_GEN_BATCH.value
    )
    return prof, work, plan, note


def _write_outputs(prof: layout.DeviceProfile, work: layout.Workload, plan: layout.Plan) -> None:

    out = Path(_OUT_DIR.value)
    hi = _PLOT_MAX_LAG.value or max(2 * work.max_lag, 16)
    sweep = layout.lag_sweep(prof, work, range(0, hi + 1))
    f1 = figures.plot_utilisation(
        prof.gen_curve, out / "utilisation.png", chosen_batch=plan.gen_batch
    )
    f2 = figures.plot_lag_sweep(
        sweep,
        out / "throughput_vs_lag.png",
        unit=plan.unit,
        chosen=(plan.lag, plan.r),
        title=f"N={work.devices} B={work.batch_size} L={work.lengths.max_len} "
        f"mean={work.lengths.mean_len:.0f}",
    )
    record = {k: v for k, v in vars(plan).items()}
    (out / "plan.json").write_text(json.dumps(record, indent=2, default=float) + "\n")
    print(f"wrote {f1}, {f2}, {out / 'plan.json'}")


def run_reproduce() -> None:
    cs = paper.case_study()
    print(paper.format_case_study(cs))
    prof = layout.DeviceProfile(paper.h100_roofline_curve(), paper.TAU)
    work = layout.Workload(
        paper.N, paper.B, model.LengthDistribution.uniform(paper.MAX_LEN), cs["g_max"]
    )
    plan = layout.plan_layout(prof, work)
    print(f"\nsame-lag search on the stand-in curve (lag bound {cs['g_max']}):")
    print(layout.format_plan(plan, work))
    _write_outputs(prof, work, plan)


def run_measure() -> None:
    import jax

    if not _MATMUL.value and not _ENGINE_MODEL.value:
        raise PlanError("measure: nothing to do with --nomatmul and no --engine_model")
    # Before minutes of timing: a model or an output path that would fail at the end.
    name = _ENGINE_MODEL.value
    if name and name != "tiny" and not Path(name).is_dir():
        raise PlanError(f"--engine_model={name}: not 'tiny' nor a checkpoint directory")
    cli.check_output_file(_OUT.value, "out")
    # Other work on the host distorts CPU timings (several-fold here): record it with the data.
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"WARNING: 1-minute load average {load:.2f}: timings may be distorted")
    profile = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "host_cpus": os.cpu_count(),
        "loadavg_1m_at_start": round(load, 2),
    }
    if _MATMUL.value:
        sizes = [int(s) for s in _BATCH_SIZES.value] if _BATCH_SIZES.value else None
        peak = _PEAK.value * 1e12 if _PEAK.value else None
        profile |= measure.matmul_profile(
            batch_sizes=sizes,
            m=_MM_M.value,
            n=_MM_N.value,
            dtype=_DTYPE.value,
            max_pad=_MAX_PAD.value,
            repeats=_REPEATS.value,
            peak_flops=peak,
        )
        u = profile["utilisation"]
        print(f"U(h) on {profile['device_kind']} ({u['source']}); peak: {u['peak_source']}")
        for h, v, k in zip(u["batch_sizes"], u["values"], u["best_padded_batch"]):
            print(f"  h={h:6g}  U={v:.3f}  (timed at padded size {k})")
    if _ENGINE_MODEL.value:
        profile.update(_engine_sections())
        d, t = profile["decode"], profile["train"]
        print(f"decode ({_ENGINE_MODEL.value}, context {d['context_len']}):")
        for b, s in zip(d["batch_sizes"], d["latency_s"]):
            print(f"  batch={b:5d}  {s * 1e3:8.3f} ms/step  {b / s:10.1f} tokens/s")
        if "kv_max_batch" in d:
            print(f"  KV-cache bound: {d['kv_max_batch']} sequences per device")
        print(
            f"train: {t['tokens_per_s_per_device']:.1f} completion tokens/s per device "
            f"({t['packed_tokens_per_s']:.1f} packed tokens/s)"
        )
    path = util.save_profile(profile, _OUT.value)
    print(f"wrote {path}")


def _engine_sections() -> dict:

    name = _ENGINE_MODEL.value
    if name == "tiny":
        graphdef, params = engine_probe.tiny_model()
    else:
        if not Path(name).is_dir():
            raise PlanError(f"--engine_model={name}: not 'tiny' nor a checkpoint directory")
        _, graphdef, params = hf_io.load_hf(name, check_tokenizer=False)
    memory = int(_KV_GIB.value * 2**30) if _KV_GIB.value else None
    return engine_probe.engine_profile(
        graphdef,
        params,
        decode_batch_sizes=[int(b) for b in _DECODE_SIZES.value],
        context_len=_CONTEXT.value,
        chunk_steps=_CHUNK.value,
        train_rows=_TRAIN_ROWS.value,
        train_seq_len=_TRAIN_SEQ.value,
        repeats=_REPEATS.value,
        memory_bytes=memory,
        source=name,
    )


def main(argv: list[str]) -> None:
    args = argv[1:]
    try:
        if args == ["measure"]:
            run_measure()
        elif args:
            raise PlanError(f"unknown command {' '.join(args)!r}; use `measure` or flags only")
        elif _REPRODUCE.value:
            run_reproduce()
        else:
            run_plan()
    except ConfigError as e:  # PlanError and the project's other one-line input errors
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    # absl's own --help exits 1; every tool of the package answers help with exit code 0.
    if cli.wants_help(sys.argv):
        flags.FLAGS.mark_as_parsed()
        print(cli.usage(__doc__, flags.FLAGS, full=cli.wants_help(sys.argv) == "--helpfull"))
        sys.exit(0)
    app.run(main)
