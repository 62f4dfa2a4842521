"""What each process of a multi-process run does: the trainer process runs the pipeline with
a RemoteSampler, sampler processes serve their own PagedSampler, and `spawn_local` runs them
all on this machine under the supervisor.

    python launch.py --spawn_local=3 --workdir=/tmp/run        # 1 trainer + 2 samplers, here
    python launch.py --coordinator=HOST0:8476 --num_processes=3 --process_id=I --workdir=...

The trainer process (process 0) does everything a single-process run does (data, admission,
rewards, training, checkpoints, evaluation on its own devices), except decoding: its
Coordinator talks to the sampler processes through `RemoteSampler` and publishes weights with a
`WeightServer`. A sampler process needs no data, no optimizer and no weights file: it builds
the model's shape from the config, pulls every weight version from the trainer, and decodes
the requests it is sent until the trainer says stop.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence

from pipelinerl_jax.distributed import runtime
from pipelinerl_jax.distributed.supervisor import Child, supervise
from pipelinerl_jax.errors import ConfigError

FIRST_WEIGHTS_TIMEOUT_S = 600  # a sampler waits this long for the trainer's first version


def process_spec(cfg, coordinator: str, num_processes: int, process_id: int):
    """The ProcessSpec for the launch flags and the config's devices.trainer_processes."""
    spec = runtime.ProcessSpec(
        coordinator, num_processes, process_id, cfg.devices.trainer_processes
    )
    if spec.trainer_processes != 1:
        raise ConfigError(
            f"devices.trainer_processes={spec.trainer_processes}: only 1 trainer process is "
            "supported so far (it trains on all its local devices); use 1"
        )
    return spec


def run_trainer(cfg, workdir, spec, echo=print) -> dict:
    """Process 0: the pipeline, decoding delegated to the sampler processes."""
    from pipelinerl_jax.distributed.remote_sampler import RemoteSampler
    from pipelinerl_jax.distributed.weight_server import WeightServer
    from pipelinerl_jax.pipeline import runner

    samplers = spec.num_processes - spec.trainer_processes
    server = WeightServer(pullers=range(spec.trainer_processes, spec.num_processes))
    remote = RemoteSampler(
        samplers, cfg.sampler.num_slots, functools.partial(server.publish, copy=False)
    )
    try:
        c = runner.build(cfg, sampler=remote)
        # The samplers' first weights; a resume publishes the checkpoint's version after it.
        remote.set_params(c.state.params, int(c.state.version))
        return runner.run(cfg, workdir, components=c, echo=echo)
    finally:
        remote.stop()
        server.close()


def run_sampler(cfg, spec, echo=print) -> int:
    """A sampler process: pulls weights, serves requests until stopped; returns attempts."""
    import jax

    from pipelinerl_jax.distributed.remote_sampler import serve
    from pipelinerl_jax.distributed.weight_client import WeightClient
    from pipelinerl_jax.models import decoder
    from pipelinerl_jax.pipeline import runner
    from pipelinerl_jax.sampler.sampler import PagedSampler

    tokenizer, _, _ = runner.build_data(cfg, load_source=False)
    graphdef, like = decoder.abstract_init(runner.model_config(cfg))
    client = WeightClient(like)
    try:
        first = client.wait(timeout_s=FIRST_WEIGHTS_TIMEOUT_S)
        if first is None:
            raise RuntimeError(
                f"{spec.name}: no weights from the trainer within {FIRST_WEIGHTS_TIMEOUT_S} s"
            )
        params, version = first
        sampler = PagedSampler(
            graphdef,
            params,
            dataclasses.replace(cfg.sampler, seed=cfg.sampler.seed + cfg.seed),
            version=version,
            eos_token_ids=tuple(getattr(tokenizer, "eos_token_ids", ())),
            mesh=runner.sampler_mesh(jax.local_devices(), cfg),
        )
        sampler.warm_up()
        echo(
            f"{spec.name}: decoding on {len(jax.local_devices())} device(s) from version {version}"
        )
        served = serve(sampler, spec.sampler_index, client.poll)
        echo(f"{spec.name}: stopped after {served} attempts")
        return served
    finally:
        client.close()


def spawn_local(argv: Sequence[str], num_processes: int, echo=print) -> int:
    """Runs `launch.py argv` as `num_processes` local processes (process 0 trains) under the
    supervisor; returns the job's exit code."""
    if num_processes < 2:
        raise ConfigError(f"--spawn_local={num_processes}: use 2 or more (1 trainer + samplers)")
    coordinator = f"127.0.0.1:{runtime.free_port()}"
    base = [a for a in argv if not a.startswith("--spawn_local")]
    children = [
        Child(
            runtime.ProcessSpec(coordinator, num_processes, i).name,
            (
                sys.executable,
                *base,
                f"--coordinator={coordinator}",
                f"--num_processes={num_processes}",
                f"--process_id={i}",
            ),
        )
        for i in range(num_processes)
    ]
    return supervise(children, echo=echo).returncode
