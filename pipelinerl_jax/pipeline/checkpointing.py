"""A run's checkpoints: resuming from the workdir, the save schedule, Ctrl-C, the curves.

    finished = preflight(cfg, workdir, stream)  # before anything loads: refusals, finished runs
    ckpt = Checkpoints(RunCheckpointer(workdir, ...), cfg, writer, workdir)
    step = resume(coord, ckpt.checkpointer, cfg, components, echo)   # None: a fresh run
    coord.on_step_end = ckpt.maybe_save  # every checkpoint_every steps, with curves.png
    ...
    except KeyboardInterrupt:
        interrupted(coord, ckpt, echo)   # saves if one is due soon, says where it resumes

Metrics come first: the coordinator logs step s before on_step_end can save a checkpoint
after it, so a checkpoint never holds a step whose record a kill could still lose.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax

from pipelinerl_jax import cli
from pipelinerl_jax.data import prompts as prompts_lib
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline.metrics import METRICS_FILE, read_records
from pipelinerl_jax.pipeline.run_plot import PLOT_FILE, plot_run
from pipelinerl_jax.train.checkpoint import CHECKPOINT_DIR, RunCheckpointer
from pipelinerl_jax.train.resume_compat import another_run, check_compatible


class Checkpoints:
    """The run's checkpoint schedule: every `checkpoint_every` steps (each redraws the
    curves), at the end, and on Ctrl-C when one is due soon (run() draws those curves)."""

    def __init__(self, checkpointer: RunCheckpointer, cfg, writer, workdir):
        self.checkpointer, self.cfg, self.writer, self.workdir = checkpointer, cfg, writer, workdir
        self.last_saved: int | None = None  # the step a relaunch would resume from

    def save(self, coord) -> None:
        extra = {"config": config_lib.as_dict(self.cfg), **coord.snapshot()}
        base = lora_base(coord.trainer)
        if base is not None:
            extra["lora_base"] = base
        self.checkpointer.save(coord.step, coord.state, extra)
        self.last_saved = coord.step

    def maybe_save(self, coord) -> None:
        """on_step_end: the coordinator has logged every step before coord.step by now."""
        if coord.step % self.cfg.checkpoint_every == 0 and coord.step < self.cfg.steps:
            self.save(coord)
            draw_curves(self.writer, self.workdir, self.writer.echo)


# Ctrl-C saves a checkpoint when the next scheduled one is at most this fraction of
# checkpoint_every away: the steps since the last save are then most of an interval's work.
INTERRUPT_SAVE_WITHIN = 0.5


def interrupted(coord, ckpt: Checkpoints | None, echo) -> None:
    """After Ctrl-C stopped the threads: saves a checkpoint if one is due soon, and says what
    a relaunch with the same workdir resumes from."""
    step = coord.step
    if ckpt is None:
        echo(
            f"interrupted at step {step}: no checkpoint saved (checkpoints need --workdir and "
            "checkpoint_every > 0); a relaunch starts over from step 0"
        )
        return
    # A stream without get_state/set_state: the checkpoints keep the params (export,
    # evaluate), but no relaunch can resume from them.
    resumable = prompts_lib.resumable(coord.stream)
    cannot = "the run cannot be resumed (its prompt stream has no get_state/set_state)"
    every = ckpt.cfg.checkpoint_every
    due = (step // every + 1) * every
    if ckpt.last_saved == step:
        then = f"relaunching with the same --workdir resumes from step {step}"
        echo(
            f"interrupted at step {step}: its checkpoint is saved; {then if resumable else cannot}"
        )
        return
    why = f"the next was due at step {due}"
    if ckpt.cfg.deterministic:
        # Mid-flight, it would hold groups that a resume regenerates at other versions.
        why = "a deterministic run saves only at drained checkpoints, to replay exactly"
    elif due - step <= INTERRUPT_SAVE_WITHIN * every:
        if coord.stopped():
            ckpt.save(coord)
            then = f"relaunching with the same --workdir resumes from step {step}"
            echo(
                f"interrupted at step {step}: saved a checkpoint ({why}); "
                f"{then if resumable else cannot}"
            )
            return
        why = "the trainer did not stop in time to save one safely"
    last = ckpt.last_saved
    if last is None:
        where = "starts over from step 0"
    else:
        again = f"step {last}" if step - last == 1 else f"steps {last}-{step - 1}"
        where = f"resumes from step {last} and trains {again} again"
    then = f"relaunching with the same --workdir {where}"
    echo(
        f"interrupted at step {step}: no checkpoint saved ({why}); {then if resumable else cannot}"
    )


def draw_curves(writer, workdir, echo) -> None:
    """<workdir>/curves.png from the whole run's records. A picture that fails to draw is
    reported in one line and does not stop the run."""
    train = writer.of_kind("train")
    if not train:
        return
    try:
        plot_run(
            train,
            writer.of_kind("eval"),
            Path(workdir) / PLOT_FILE,
            title=f"{workdir} ({train[-1]['step'] + 1} steps)",
        )
    except Exception as e:  # noqa: BLE001 - matplotlib or the disk; the run matters more
        echo(f"warning: could not draw {Path(workdir) / PLOT_FILE}: {type(e).__name__}: {e}")


def check_own_config(workdir) -> None:
    """A one-line ConfigError when the workdir's config.json is not a run's: a run writes its
    own there, and a Hugging Face model directory given as --workdir (for model.hf_dir) would
    lose its config.json to it."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        return
    unreadable = ""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        saved, unreadable = None, f"(unreadable: {e.msg if hasattr(e, 'msg') else e}) "
    if isinstance(saved, dict) and {"max_lag", "sampler", "trainer"} <= saved.keys():
        return  # a run's config: this run resumes it or starts over it
    if isinstance(saved, dict) and ("architectures" in saved or "model_type" in saved):
        fix = f"(a Hugging Face model's): pass the model as --config.model.hf_dir={workdir} and"
    else:
        fix = f"{unreadable}(the run would overwrite it): move it, or"
    raise ConfigError(
        f"--workdir={workdir} holds a config.json that is not a run's {fix} name a new "
        "--workdir for the run"
    )


def preflight(cfg, workdir, stream=None, echo=print) -> int | None:
    """Before anything loads: raises ConfigError for a config change the workdir's newest
    checkpoint cannot take, for a resume the prompt stream cannot make (`stream`: the one
    the run was given, None for the config's own; see data/prompts.py), for checkpoints a
    run with checkpoint_every=0 would train past and never replace, and for a checkpoints
    folder it cannot write; returns that checkpoint's step when it is at cfg.steps or later
    (the run is finished), else None. Without a checkpoint, see `_check_fresh_start`."""
    ckpt = RunCheckpointer(workdir, read_only=True)
    try:
        latest = ckpt.latest_step()
        if latest is None:
            _check_fresh_start(cfg, workdir, echo)
        else:
            try:
                extra = ckpt.read_json(latest, "extra")
                saved = extra["config"]
            except Exception:  # noqa: BLE001 - a damaged step: resume() falls back past it
                extra = None
            if extra is not None:
                check_compatible(saved, config_lib.as_dict(cfg))
                if latest >= cfg.steps:
                    return latest
            if not cfg.checkpoint_every:
                raise ConfigError(
                    f"--workdir={workdir} holds checkpoints up to step {latest}, and "
                    "config.checkpoint_every=0 would train on from there saving none (a "
                    "relaunch would train those steps again): set checkpoint_every, or name "
                    "a new --workdir"
                )
            if extra is not None and "data" in extra and extra["data"] is None:
                raise prompts_lib.no_saved_position(latest)
            if stream is not None and not prompts_lib.resumable(stream):
                raise prompts_lib.not_resumable(stream, latest)
    finally:
        ckpt.close()
    if cfg.checkpoint_every:  # before training, not at the first save; made by the run
        cli.check_dir(
            str(Path(workdir) / CHECKPOINT_DIR),
            create=False,
            where=f"--workdir={workdir}'s {CHECKPOINT_DIR}/",
        )
    return None


def _check_fresh_start(cfg, workdir, echo) -> None:
    """A workdir without a checkpoint but with a run's train records (killed before its first
    checkpoint, or one saving none) starts over, said in one line: its records stay and the
    new ones follow a start record. One whose config.json is another run's (a change a resume
    would refuse) is refused instead of mixed into."""
    trained = sum(r["kind"] == "train" for r in read_records(Path(workdir) / METRICS_FILE))
    if not trained:
        return
    saved = None
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads((Path(workdir) / "config.json").read_text())
    other = another_run(saved, config_lib.as_dict(cfg)) if isinstance(saved, dict) else None
    if other:
        raise ConfigError(
            f"--workdir={workdir} holds {trained} steps of another run ({other}) and no "
            "checkpoint: name a new --workdir, or move its files away to start over there"
        )
    echo(
        f"no checkpoint in {workdir}: starting from step 0 (the {trained} steps an earlier "
        f"launch logged stay in {METRICS_FILE})"
    )


def lora_base(trainer) -> dict | None:
    """What a LoRA checkpoint records of the frozen base its adapters were trained on (the
    trainer's fingerprint of it), or None without LoRA."""
    fingerprint = getattr(trainer, "base_fingerprint", None)
    return None if fingerprint is None else {"sha256": fingerprint}


def check_lora_base(saved: dict | None, trainer, step: int) -> None:
    """Refuses (one line) to resume adapters onto base weights other than those they were
    trained on: the same hf_dir path with other contents, say."""
    now = lora_base(trainer)
    if saved is None or now is None or saved["sha256"] == now["sha256"]:
        return
    raise ConfigError(
        f"checkpoint step {step}: its LoRA adapters were trained on other base weights "
        f"(sha256 {saved['sha256'][:12]}..., now {now['sha256'][:12]}...); restore the base "
        "model the run started from (model.hf_dir) or start a new --workdir"
    )


def resume(coord, ckpt, cfg, c, echo) -> int | None:
    """Continues the workdir's run from its newest good checkpoint; returns its step (None:
    there is none, the run starts fresh)."""
    latest = ckpt.latest_step()
    if latest is not None:
        try:  # name the offending field before Orbax meets mismatched arrays
            saved = ckpt.read_json(latest, "extra")["config"]
        except Exception:  # noqa: BLE001 - a damaged step: restore_latest falls back below
            saved = None
        if saved is not None:
            check_compatible(saved, config_lib.as_dict(cfg))
    abstract = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        c.state,
        c.trainer.state_shardings,
    )
    restored = ckpt.restore_latest(abstract)
    if restored is None:
        return None
    step, state, extra = restored
    check_lora_base(extra.get("lora_base"), c.trainer, step)
    for change in check_compatible(extra["config"], config_lib.as_dict(cfg)):
        echo(f"resume: config change allowed: {change}")
    coord.restore(extra)  # first: it refuses a stream it cannot reposition
    coord.state = state
    coord.hand_params(state.params, step)
    echo(f"resumed from step {step}: {len(extra['pending'])} untrained groups carried over")
    return step
