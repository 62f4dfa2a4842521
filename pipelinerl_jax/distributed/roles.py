"""What each process of a multi-process run does: trainer process 0 runs the pipeline with
a RemoteSampler, the other trainer processes follow its trainer calls, sampler processes serve
their own PagedSampler, and `spawn_local` runs them all on this machine under the supervisor.

    python launch.py --spawn_local=3 --workdir=/tmp/run        # 1 trainer + 2 samplers, here
    python launch.py --spawn_local=3 --config.devices.trainer_processes=2 ...  # 2 + 1
    python launch.py --coordinator=HOST0:8476 --num_processes=3 --process_id=I --workdir=...

Trainer process 0 does everything a single-process run does (data, admission, rewards,
training, checkpoints, evaluation on its own devices), except decoding: its Coordinator talks
to the sampler processes through `RemoteSampler` and publishes weights with a `WeightServer`.
With `devices.trainer_processes` > 1 the trainer mesh spans processes 0..T-1 and the others
replay process 0's train steps, gathers and checkpoints (trainer_group.py). A sampler process
needs no data, no optimizer and no weights file: it builds the model's shape from the config,
pulls every weight version from process 0, and decodes the requests it is sent until stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence

from pipelinerl_jax.distributed import failures, runtime
from pipelinerl_jax.distributed.remote_sampler import RemoteSampler, member_name, serve
from pipelinerl_jax.distributed.supervisor import Child, supervise
from pipelinerl_jax.distributed.trainer_group import Leader, follow, group_devices
from pipelinerl_jax.distributed.weight_client import WeightClient
from pipelinerl_jax.distributed.weight_server import WeightServer
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, lora
from pipelinerl_jax.pipeline import components, runner
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.train.checkpoint import RunCheckpointer
from pipelinerl_jax.train.trainer import Trainer, trainer_mesh

FIRST_WEIGHTS_TIMEOUT_S = 600  # a sampler waits this long for the trainer's first version


def process_spec(
    cfg, coordinator: str, num_processes: int, process_id: int, *, elastic: bool = False
):
    """The ProcessSpec for the launch flags and the config's devices.trainer_processes."""
    if cfg.env.name:
        # A remote sampler serves whole attempts; resuming a parked episode across
        # processes (its KV pages stay with its sampler) is not built.
        raise ConfigError(
            f"config.env.name={cfg.env.name!r}: multi-turn episodes run in one process; "
            "drop --num_processes / --spawn_local, or the env section"
        )
    if cfg.deterministic:
        raise ConfigError(
            "config.deterministic runs in one process (sampler processes answer when they "
            "answer); drop --num_processes / --spawn_local, or deterministic"
        )
    return runtime.ProcessSpec(
        coordinator, num_processes, process_id, cfg.devices.trainer_processes, elastic
    )


def _trainer_devices(spec) -> list:
    """The trainer mesh's devices: every device of the trainer processes (the samplers are
    other processes; held-out evaluation shares process 0's)."""

    return group_devices(spec.trainer_processes)


def run_trainer(cfg, workdir, spec, echo=print) -> dict:
    """Process 0: the pipeline, decoding delegated to the sampler processes."""

    samplers = spec.num_processes - spec.trainer_processes
    elastic = {}
    if spec.elastic:  # samplers register their pullers, and may go and come back
        server = WeightServer(pullers=(), keep_latest=True)

        def on_lost(name, line):
            server.remove_puller(name)
            echo(line)

        elastic = {
            "lost": failures.Liveness(spec).lost,
            "on_lost": on_lost,
            "on_joined": lambda name, line: echo(line),
        }
    else:
        server = WeightServer(pullers=range(spec.trainer_processes, spec.num_processes))
    leader = None
    prepare = None
    if spec.trainer_processes > 1:
        # The followers' work is this process's trainer calls, so they are wired before the
        # first one (the initial gather below).
        leader = _LeaderRef()
        prepare = leader.local_params
    remote = RemoteSampler(
        samplers,
        cfg.sampler.num_slots,
        functools.partial(server.publish, copy=False),
        prepare=prepare,
        **elastic,
    )
    try:
        c = components.build(cfg, sampler=remote, trainer_devices=_trainer_devices(spec))
        if leader is not None:
            leader.target = Leader(c.trainer, followers=range(1, spec.trainer_processes))
            c.trainer = leader.target
            c.local_params = leader.target.local_full_params  # evaluation: the whole model
            c.make_checkpointer = leader.target.checkpointer
        # The samplers' first weights; a resume publishes the checkpoint's version after it.
        remote.set_params(c.state.params, int(c.state.version))
        return runner.run(cfg, workdir, components=c, echo=echo)
    finally:
        if leader is not None and leader.target is not None:
            leader.target.stop()
        remote.stop()
        server.close()


class _LeaderRef:
    """The Leader, once built (RemoteSampler needs its gather before build() makes it)."""

    target = None

    def local_params(self, params):
        return self.target.local_params(params)


def run_follower(cfg, workdir, spec, echo=print) -> dict:
    """Trainer process 1..T-1: its shards of the trainer, replaying process 0's calls."""
    import jax

    # What build() does for the trainer, in the same order: the same init (or weights file)
    # on every trainer process, then the collective placement onto the global mesh.
    tokenizer, _, _ = components.build_data(cfg, load_source=False)
    graphdef, params = components.build_model(cfg, tokenizer, jax.random.key(cfg.seed))
    mesh = trainer_mesh(_trainer_devices(spec), tp=cfg.devices.trainer_tp)
    trainer = Trainer(cfg.trainer, graphdef, jax.eval_shape(lambda: params), mesh)
    trainer.check_rows(cfg.batch.num_rows)
    state = trainer.init_state(params)

    open_checkpointer = functools.partial(
        RunCheckpointer,
        workdir,
        keep=cfg.checkpoint_keep,
        model_config=decoder.config_of(graphdef),
        processes=range(spec.trainer_processes),
    )
    echo(f"{spec.name}: following process 0 on {len(mesh.devices.flat)} trainer device(s)")
    counts = follow(trainer, state, open_checkpointer, spec.process_id, trim=cfg.trim_host_memory)
    echo(f"{spec.name}: stopped after {counts.get('step', 0)} train steps")
    return counts


def run_sampler(cfg, spec, echo=print) -> int:
    """A sampler process: pulls weights, serves requests until stopped; returns attempts."""
    import jax

    tokenizer, _, _ = components.build_data(cfg, load_source=False)
    graphdef, like = decoder.abstract_init(components.model_config(cfg))
    base = None
    if decoder.config_of(graphdef).lora is not None:
        # LoRA: only adapters travel. The frozen base is built here from the run's config, as
        # the trainer built its own (the same hf_dir weights, or the same seed's init).
        _, full = components.build_model(cfg, tokenizer, jax.random.key(cfg.seed))
        _, base = lora.split(decoder.arrays(full))
        like, _ = lora.split(like)  # nnx Variables, as the trainer's state holds them
    name = member_name(spec.sampler_index)
    client = WeightClient(like, puller=name if spec.elastic else None)
    try:
        first = client.wait(timeout_s=FIRST_WEIGHTS_TIMEOUT_S)
        if first is None:
            raise RuntimeError(
                f"{spec.name}: no weights from the trainer within {FIRST_WEIGHTS_TIMEOUT_S} s"
            )
        params, version = first
        if base is not None:
            params = lora.merge(params, base)
        sampler = PagedSampler(
            graphdef,
            params,
            dataclasses.replace(cfg.sampler, seed=cfg.sampler.seed + cfg.seed),
            version=version,
            eos_token_ids=tuple(getattr(tokenizer, "eos_token_ids", ())),
            mesh=components.sampler_mesh(jax.local_devices(), cfg),
        )
        sampler.warm_up()
        echo(
            f"{spec.name}: decoding on {len(jax.local_devices())} device(s) from version {version}"
        )
        served = serve(sampler, spec.sampler_index, client.poll, name=name)
        pulled = client.stats
        echo(
            f"{spec.name}: stopped after {served} attempts; {pulled['pulls']} weight versions "
            f"pulled, {pulled['bytes']} bytes"
        )
        return served
    finally:
        client.close()


def spawn_local(
    argv: Sequence[str],
    num_processes: int,
    echo=print,
    *,
    trainer_processes: int = 1,
    elastic: bool = False,
) -> int:
    """Runs `launch.py argv` as `num_processes` local processes (the first
    `trainer_processes` train) under the supervisor; returns the job's exit code."""
    if num_processes < 2:
        raise ConfigError(f"--spawn_local={num_processes}: use 2 or more (1 trainer + samplers)")
    coordinator = f"127.0.0.1:{runtime.free_port()}"
    base = [a for a in argv if not a.startswith("--spawn_local")]
    specs = [
        runtime.ProcessSpec(coordinator, num_processes, i, trainer_processes, elastic)
        for i in range(num_processes)
    ]
    children = [
        Child(
            spec.name,
            (
                sys.executable,
                *base,
                f"--coordinator={coordinator}",
                f"--num_processes={num_processes}",
                f"--process_id={spec.process_id}",
            ),
            spare=elastic and spec.role == "sampler",
        )
        for spec in specs
    ]
    return supervise(children, echo=echo).returncode
