"""launch.py --dry_run: the checks a run makes before it loads or compiles anything, then stop.

From a validated RunConfig: the task's options (built, not drawn from), the dataset files
(read and mapped to problems, as the run reads them), the reward function (imported), a LoRA
adapter to start from (its config and tensor shapes), the process flags (launch.py), the devices split into the sampler and
trainer meshes as the run splits them (`pipeline.components.split_devices`), the model's shape
(from model.hf_dir's config.json or model.init; no weights) and the run's own start-up memory
estimate (`memory.estimate`, refused with one line when it cannot fit, as a run is). Prints the
resolved config as JSON, then the devices, the parameter count and the memory estimate.

With a GPU named (`launch.py --dry_run --gpu=h100`), then also whether each role of this run
fits in that GPU's memory per device and its roofline decode-step and train-step times
(plan/gpu_run.py, the planner's own report), refused with one line when a role cannot fit.
"""

from __future__ import annotations

import json

import jax

from pipelinerl_jax.data.datasets import load_problems
from pipelinerl_jax.data.tasks import make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import param_counts, peft_io
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import host_memory, memory
from pipelinerl_jax.pipeline.components import check_text_has_model, model_config, split_devices
from pipelinerl_jax.plan import gpu_run
from pipelinerl_jax.plan.gpu_specs import GpuSpec
from pipelinerl_jax.rewards.tables import reward_fn_spec


def dry_run(
    cfg: config_lib.RunConfig, echo=print, gpu: GpuSpec | None = None, processes=None
) -> dict:
    """Checks cfg as a run would before building anything; returns what it printed, as a dict.
    `gpu`: also predict each role on that GPU, at this machine's device split. `processes`:
    a multi-process launch's distributed.runtime.ProcessSpec, whose roles are said."""
    if cfg.data.task:
        make_task(cfg.data.task, **dict(cfg.data.task_options))
    # The files read and mapped as the run reads them: a format that fits none of their
    # records is refused here, not after the workdir is made.
    counts = {
        side: len(load_problems(specs, f"{section}.datasets"))
        for side, section, specs in (
            ("train", "data", cfg.data.datasets),
            ("eval", "eval", cfg.eval.datasets),
        )
        if specs
    }
    check_text_has_model(cfg)  # after the files: a missing one is the first thing to fix
    reward_fn_spec(cfg.reward.fn)
    devices = jax.local_devices()
    sampler_devices, trainer_devices = split_devices(devices, cfg.devices)
    cfg.sampler.check_shards(len(sampler_devices) // cfg.devices.sampler_tp)
    model_cfg = model_config(cfg)
    if cfg.model.lora_init:  # its config and tensor shapes, from the file headers alone
        peft_io.check_peft(cfg.model.lora_init, model_cfg)
    # The same estimate and refusal as the run's start-up check (pipeline.components.check_memory).
    est = memory.estimate(cfg, model_cfg, shared_device=True)
    shared = " (shared)" if sampler_devices == trainer_devices else ""
    out = {
        "config": config_lib.as_dict(cfg),
        "devices": {
            "platform": devices[0].platform,
            "sampler": len(sampler_devices),
            "trainer": len(trainer_devices),
        },
        "params": param_counts.num_params(model_cfg),
        "memory_gib": est.total / memory.GiB,
    }
    echo(json.dumps(out["config"], indent=2, default=str))
    echo(
        f"devices: {devices[0].platform} x {len(devices)}: sampler {len(sampler_devices)}, "
        f"trainer {len(trainer_devices)}{shared}"
    )
    if counts:
        echo("data: " + ", ".join(f"{n} {where} problems" for where, n in counts.items()))
        out["problems"] = counts
    echo(
        f"model: {model_cfg.model_type}, {model_cfg.num_layers} layers, hidden "
        f"{model_cfg.hidden_size}: {out['params']:,} parameters ({model_cfg.param_dtype})"
    )
    echo(str(est))
    memory.check_fits(est, host_memory.available_bytes())
    if gpu is not None:
        report = gpu_run.gpu_report(
            cfg,
            model_cfg,
            gpu,
            sampler_devices=len(sampler_devices),
            trainer_devices=len(trainer_devices),
            shared=sampler_devices == trainer_devices,
        )
        out["gpu"] = report.lines
        for line in report.lines:
            echo(line)
        if report.problem:
            raise ConfigError(report.problem)
    if processes is not None:  # the devices line above is each process's own
        trainers = processes.trainer_processes
        ids = "id 0" if trainers == 1 else f"ids 0..{trainers - 1}"
        echo(
            f"processes: {processes.num_processes}: trainer {trainers} ({ids}), sampler "
            f"{processes.num_processes - trainers}"
            + (" (elastic: they may leave and join)" if processes.elastic else "")
            + "; the devices line is one process's"
        )
    echo("dry run: the config is valid; nothing was loaded or compiled")
    return out
