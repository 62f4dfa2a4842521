"""Execute a run: the sampler and trainer threads, checkpoints, metrics, the summary.

    from pipelinerl_jax import pipeline, presets
    summary = pipeline.run(presets.tiny(steps=2), "/tmp/run")          # a preset
    summary = pipeline.run(cfg, "/tmp/run", prompts=my_problems())     # your own prompt stream

`run(cfg, workdir, *, prompts=None, loss_fn=None, optimizer=None)`: `prompts` replaces the
stream the config describes (any iterable of data.formats.Problem; see data/prompts.py for
what checkpoints keep of it); `loss_fn` and `optimizer` go to the Trainer, and only when given.
`run(..., components=c)` runs parts built by `build(cfg)` (components.py) instead, some of
them replaced first.

Before anything loads, the workdir is checked (a refused resume or a finished run stops here,
config.json untouched) and the memory estimate is printed; then the parts are built, the
Coordinator is wired to a reward pool, the weight Publisher, the metrics writer and the
checkpoint schedule, resumed from the newest checkpoint if there is one, and run.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax

from pipelinerl_jax import interrupts
from pipelinerl_jax.data import prompts as prompts_lib
from pipelinerl_jax.envs.runner import EnvironmentPool
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import workdir_lock
from pipelinerl_jax.pipeline.checkpointing import (
    Checkpoints,
    check_own_config,
    draw_curves,
    interrupted,
    preflight,
    resume,
)
from pipelinerl_jax.pipeline.compile_watch import CompileWatch, enable_persistent_cache
from pipelinerl_jax.pipeline.components import (
    Components,
    build,
    build_evaluator,
    check_memory,
    check_text_has_model,
)
from pipelinerl_jax.pipeline.coordinator import Coordinator
from pipelinerl_jax.pipeline.diagnostics import RewardDiagnostics
from pipelinerl_jax.pipeline.episodes import make_driver
from pipelinerl_jax.pipeline.groups import completion_text
from pipelinerl_jax.pipeline.metrics import MetricsWriter
from pipelinerl_jax.pipeline.progress import Progress
from pipelinerl_jax.pipeline.summary import format_summary, summarize
from pipelinerl_jax.pipeline.weights import Publisher
from pipelinerl_jax.rewards.tables import get_reward_table
from pipelinerl_jax.rewards.workers import RewardPool


def run(
    cfg: config_lib.RunConfig,
    workdir: str | None = None,
    *,
    prompts=None,
    loss_fn=None,
    optimizer=None,
    devices=None,
    components: Components | None = None,
    echo=print,
) -> dict:
    """Trains for cfg.steps optimizer steps; returns the run summary (also in metrics.jsonl).

    prompts: draw from this iterable of data.formats.Problem instead of the config's stream
    (a generator works; resuming then needs get_state/set_state, see data/prompts.py).
    loss_fn, optimizer: the Trainer's, forwarded only when given. components: run these
    (from build(), parts replaced) instead of building them; prompts, loss_fn and optimizer
    then go to build().

    A workdir whose newest checkpoint is at cfg.steps or later holds a finished run: that is
    said, nothing is trained or written, and {"finished_at": step} is returned. Ctrl-C
    (KeyboardInterrupt) saves a checkpoint if one is due soon, says what a relaunch resumes
    from, and is re-raised. ConfigError (one line): a bad config or workdir, or a resume the
    prompt stream cannot make."""
    extras = (("prompts", prompts), ("loss_fn", loss_fn), ("optimizer", optimizer))
    given = [name for name, value in extras if value is not None]
    if components is not None and given:
        raise ConfigError(
            f"run(components=..., {', '.join(given)}=...): the components already hold their "
            f"stream and trainer; pass {', '.join(given)} to build() instead"
        )
    stream = None
    if components is not None:
        stream = components.stream
    elif prompts is not None:
        stream = prompts = prompts_lib.as_stream(prompts)
    if components is None:
        check_text_has_model(cfg)  # refused before the workdir is touched, as by the dry run
    if cfg.compile_cache:  # a folder it cannot make is refused before the workdir is touched
        enable_persistent_cache(cfg.compile_cache)
    if workdir:
        check_own_config(workdir)  # never overwrite a model's config.json
        Path(workdir).mkdir(parents=True, exist_ok=True)
    with workdir_lock.hold(workdir) if workdir else contextlib.nullcontext():
        finished = _claim(cfg, workdir, stream, echo) if workdir else None
        if finished is not None:
            return {"finished_at": finished}
        if components is None:
            check_memory(cfg, echo)  # before anything loads or compiles
        watch = CompileWatch(echo=echo).install()
        try:
            if components is None:
                components = build(
                    cfg, devices, prompts=prompts, loss_fn=loss_fn, optimizer=optimizer
                )
            return _run(cfg, workdir, components, echo, watch)
        finally:
            watch.uninstall()


def _claim(cfg: config_lib.RunConfig, workdir: str, stream, echo) -> int | None:
    """Checks the workdir (its lock held) and writes the run's config.json there; returns the
    step of a run finished already (said, nothing written), else None."""
    # May refuse the config or the resume: config.json stays as it was.
    finished = preflight(cfg, workdir, stream, echo)
    if finished is not None:
        echo(
            f"already finished at step {finished} (config.steps={cfg.steps}): nothing to "
            "train; raise config.steps to train it further"
        )
        return finished
    # Renamed into place: a process starting beside this one (check_own_config) never reads
    # half a file.
    tmp = Path(workdir) / ".config.json.tmp"
    tmp.write_text(json.dumps(config_lib.as_dict(cfg), indent=2, default=str))
    os.replace(tmp, Path(workdir) / "config.json")
    return None


def _run(
    cfg: config_lib.RunConfig,
    workdir: str | None,
    c: Components,
    echo: Callable[[str], object],
    watch: CompileWatch,
) -> dict:
    # On a terminal the default console gets a bar over the steps; logs and pipes get lines.
    progress = Progress(cfg.steps, enabled=None if echo is print else False)
    if progress.bar is not None:
        echo = watch.echo = progress.echo
    writer = MetricsWriter(workdir, echo_every=cfg.log_every, echo=echo, on_train=progress.advance)
    try:
        return _train(cfg, workdir, c, writer, echo, watch)
    finally:
        writer.close()
        progress.close()


def _train(
    cfg: config_lib.RunConfig,
    workdir: str | None,
    c: Components,
    writer: MetricsWriter,
    echo: Callable[[str], object],
    watch: CompileWatch,
) -> dict:
    checkpoints = bool(workdir and cfg.checkpoint_every)
    table = get_reward_table(cfg.reward.table, **dict(cfg.reward.table_options))
    stop_ids = tuple(getattr(c.tokenizer, "eos_token_ids", ()))
    detok = lambda ids: completion_text(c.tokenizer, ids, stop_ids)
    shared = " (shared)" if len(jax.local_devices()) == 1 else ""
    echo(
        f"pipelinerl_jax: mode={cfg.mode} lag bound={c.admission.lag_bound()} "
        f"steps={cfg.steps} batch={cfg.batch_size} ({cfg.groups_per_step} groups x "
        f"{cfg.group_size}) devices: sampler {c.num_sampler_devices}, trainer "
        f"{c.num_trainer_devices}{shared}"
    )
    if checkpoints and not prompts_lib.resumable(c.stream):
        echo(
            f"note: the prompt stream ({type(c.stream).__name__}) has no get_state/set_state: "
            "checkpoints hold everything but its position, and this run cannot be resumed"
        )
    resumed = None
    env_pool = (
        EnvironmentPool(num_workers=cfg.env.workers, timeout_s=cfg.env.timeout_s)
        if cfg.env.name
        else contextlib.nullcontext()
    )
    with (
        RewardPool(
            cfg.reward.fn, num_workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s
        ) as pool,
        env_pool,
    ):
        episodes = None
        if cfg.env.name:
            episodes = make_driver(
                cfg.env, c.tokenizer, env_pool, max_new_tokens=cfg.max_new_tokens
            )
        coord = Coordinator(
            cfg,
            sampler=c.sampler,
            trainer=c.trainer,
            state=c.state,
            stream=c.stream,
            encode_prompt=c.encode_prompt,
            detokenize=detok,
            reward_pool=pool,
            reward_table=table,
            publisher=Publisher(
                c.sampler.prepare,
                publishes=c.admission.publishes,
                swap_when_ready=not c.shared_devices,
                keep_all=cfg.deterministic,
            ),
            admission=c.admission,
            writer=writer,
            evaluator=build_evaluator(cfg, c, pool, env_pool if cfg.env.name else None),
            compile_watch=watch,
            diagnostics=RewardDiagnostics(
                workdir, echo=echo, log_every=cfg.log_every, seed=cfg.seed
            ),
            episodes=episodes,
        )
        # The checkpointer is made once everything before it has been checked (a bad reward
        # function, say), and closed however the run ends: Orbax starts a thread with it, and
        # an exit that left it open raced that thread's work (a traceback after a one-line
        # error).
        ckpt, started = None, False
        try:
            if checkpoints:
                ckpt = Checkpoints(
                    c.make_checkpointer(
                        workdir,
                        keep=cfg.checkpoint_keep,
                        model_config=decoder.config_of(c.graphdef),
                    ),
                    cfg,
                    writer,
                    workdir,
                )
                resumed = resume(coord, ckpt.checkpointer, cfg, c, echo)
                ckpt.last_saved = resumed
                coord.on_step_end = ckpt.maybe_save
                coord.drain_every = cfg.checkpoint_every  # deterministic: drained checkpoints
            writer.start(resumed)  # after a resume, the summary and curves cover the whole run
            t0, started = time.perf_counter(), True
            coord.run()
            if ckpt is not None:
                ckpt.save(coord)
        except KeyboardInterrupt:
            interrupts.received()
            if started:  # not while resuming: the state is not the run's yet
                interrupted(coord, ckpt, echo)
            raise
        finally:
            if ckpt is not None:
                ckpt.checkpointer.close()  # waits for the last asynchronous write
            if workdir:
                draw_curves(writer, workdir, echo)
        wall = time.perf_counter() - t0
    c.state = coord.state
    summary = summarize(writer.of_kind("train"), wall, coord)
    if resumed is not None:
        summary["resumed_from"] = resumed
    evals = writer.of_kind("eval")
    if evals:
        summary["eval/last"] = {
            k: v
            for k, v in evals[-1].items()
            if k in ("step", "avg@k", "pass@k", "k", "num_problems")
        }
        summary["eval/avg@k_by_step"] = [(r["step"], r["avg@k"]) for r in evals]
    writer.write("summary", summary)
    echo(format_summary(summary))
    return summary
