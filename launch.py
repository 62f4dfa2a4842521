"""Launch a PipelineRL run: a config file, plus command-line overrides, -> pipeline.run.

    python launch.py                                     # the embedded default (configs/default.py)
    python launch.py --config=configs/default.py --workdir=/tmp/run --config.trainer.learning_rate=1e-3
    python launch.py --config.data.task_options='{"max_digits": 4}' --config.reward.timeout_s=10
    python launch.py --dry_run                           # check, print config, params, memory; exit
    python launch.py --dry_run --gpu=h100                # + fits an H100? roofline step times
    python launch.py --spawn_local=3                     # 1 trainer + 2 sampler processes, here
    python launch.py --help                              # these flags and every config field

Any config field can be set with --config.<field>=<value>, including fields the config file
leaves out; values are JSON when they parse (numbers, true/false, null, lists, objects), else
text. Bad configuration (unknown field, bad value, missing or broken config file, unwritable
workdir) exits with code 2 and a one-line message before anything compiles. Third-party INFO
logs (absl, Orbax, JAX) are off unless --verbosity asks for them (--verbosity=0: INFO).
"""

import gc
import logging
import os
import signal
import sys

from absl import app, flags
from absl import logging as absl_logging

from pipelinerl_jax import cli, config_cli, glibc_malloc, interrupts
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.plan.gpu_run import gpu_for_flag

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")
_CONFIG = flags.DEFINE_string(
    "config",
    _DEFAULT,
    "Python config file whose get_config() "
    "returns an ml_collections.ConfigDict; --config.<field>=<value> "
    "overrides any field (listed by --help).",
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Run directory: metrics.jsonl, config.json, "
    "samples.jsonl, checkpoints; launching again resumes.",
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Validate the config, resolve the devices, print "
    "the resolved config, parameter count and memory estimate, and "
    "exit without loading weights or compiling.",
)
# allow_override: the planner (python -m pipelinerl_jax.plan) defines its own --gpu, and a test
# process imports both modules; either definition reads the same string.
_GPU = flags.DEFINE_string(
    "gpu",
    None,
    "With --dry_run: a GPU (h100, h200) to check the run against: whether each role fits in its "
    "memory per device, and predicted (roofline) decode-step and train-step times.",
    allow_override=True,
)
_SPAWN_LOCAL = flags.DEFINE_integer(
    "spawn_local",
    0,
    "Run as this many local processes under one supervisor: processes 0..trainer_processes-1 train, the others "
    "sample (each on all its devices); the first failure ends them all, named in one line.",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator",
    None,
    "host:port of process 0's jax.distributed coordinator (a multi-process run; the same on "
    "every process).",
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    1,
    "Processes in a multi-process run (the first devices.trainer_processes train, the rest sample).",
)
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index, 0..num_processes-1.")
_ELASTIC = flags.DEFINE_bool(
    "elastic",
    False,
    "Multi-process runs: a sampler process that dies or stops answering is dropped and its "
    "requests resent; one started again with its launch command rejoins. The trainer's death "
    "still ends the run.",
)


def _check_process_flags(cfg):
    """The ProcessSpec of a multi-process launch (None for one process); raises a one-line
    ConfigError for process flags a run would refuse or ignore: the
    layout of a multi-process run (processes, ids, coordinator, trainer_processes), and flags
    given where they mean nothing (--process_id, --coordinator, --elastic without several
    processes; --num_processes and the rest beside --spawn_local, which sets them itself)."""
    from pipelinerl_jax.distributed import roles

    given = [f"--{name}" for name in ("coordinator", "num_processes", "process_id")]
    given = [f for f in given if flags.FLAGS[f[2:]].present]
    them = lambda names: "it" if len(names) == 1 else "them"
    if _SPAWN_LOCAL.value:
        if _SPAWN_LOCAL.value < 2:
            raise ConfigError(
                f"--spawn_local={_SPAWN_LOCAL.value}: use 2 or more (1 trainer + samplers), "
                "or leave it out for one process"
            )
        if given:
            raise ConfigError(
                f"{', '.join(given)}: --spawn_local sets {them(given)} for its processes "
                f"itself; leave {them(given)} out"
            )
        # The children's settings, checked once here rather than failing in each child.
        return roles.process_spec(cfg, "127.0.0.1:1", _SPAWN_LOCAL.value, 0, elastic=_ELASTIC.value)
    elif _NUM_PROCESSES.value > 1:
        if not _COORDINATOR.value:
            raise ConfigError("--num_processes > 1 needs --coordinator=host:port (process 0's)")
        return roles.process_spec(
            cfg, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, elastic=_ELASTIC.value
        )
    elif _NUM_PROCESSES.value < 1:
        raise ConfigError(
            f"--num_processes={_NUM_PROCESSES.value}: use 2 or more for a multi-process run, or "
            "leave it out for one process"
        )
    else:
        # --num_processes=1 --process_id=0 (a script's generic flags) describe one process.
        alone = [f for f in given if f != "--num_processes"]
        alone = [f for f in alone if f != "--process_id" or _PROCESS_ID.value != 0]
        alone += ["--elastic"] * _ELASTIC.value
        if alone:
            raise ConfigError(
                f"{', '.join(alone)}: for multi-process runs; add --spawn_local=N or "
                f"--num_processes=N (with --coordinator and --process_id), or leave {them(alone)} "
                "out"
            )


def _multi_process(cfg):
    """Runs this process's role of a multi-process run; returns its exit code."""
    from pipelinerl_jax.distributed import roles, runtime

    spec = roles.process_spec(
        cfg, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, elastic=_ELASTIC.value
    )
    runtime.initialize(spec)
    from pipelinerl_jax.distributed import failures

    failures.watch(spec)
    try:
        if spec.process_id == 0:
            roles.run_trainer(cfg, _WORKDIR.value, spec)
        elif spec.role == "trainer":
            roles.run_follower(cfg, _WORKDIR.value, spec)
        else:
            roles.run_sampler(cfg, spec)
    except BaseException as e:  # Ctrl-C included: the other processes must stop too
        if isinstance(e, KeyboardInterrupt):
            interrupts.received()
        failures.report(spec, e)
        raise
    import jax

    failures.finished(spec)
    if spec.elastic:
        # Recoverable tasks skip JAX's shutdown barrier, so process 0 could take the
        # coordination service down under a sampler still shutting down (which aborts it):
        # a sampler leaves without shutdown, and process 0 waits until every live one has.
        if spec.role == "sampler":
            return 0
        failures.wait_for_samplers(spec)
    jax.distributed.shutdown()  # every process meets here before any of them exits
    return 0


def main(argv, overrides):
    if len(argv) > 1:
        _fail("error", f"unexpected arguments {argv[1:]}; flags look like --name=value")
    gpu = None
    if _GPU.value is not None:
        if not _DRY_RUN.value:
            _fail(
                "error", f"--gpu={_GPU.value} is for --dry_run: add --dry_run, or leave --gpu out"
            )
        try:
            gpu = gpu_for_flag(_GPU.value)
        except ConfigError as e:
            _fail("error", e)
    if not flags.FLAGS["verbosity"].present:
        # absl turns INFO on once flags are parsed; Orbax alone then prints ~60 lines per
        # checkpoint. Our own progress lines are printed, not logged, so they still show.
        absl_logging.set_verbosity(absl_logging.WARNING)
    # Ctrl-C / SIGINT must stop the run even when the parent ignored or blocked SIGINT (signal
    # dispositions and masks are inherited through fork + exec, e.g. from test runners and
    # job wrappers). Done before JAX starts its threads, which inherit this thread's mask.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    interrupts.install()
    glibc_malloc.limit_arenas()  # before JAX's threads too (pipelinerl_jax/glibc_malloc.py)

    try:
        cfg = config_cli.load_run_config(_CONFIG.value, overrides)
        if cfg.deterministic:
            from pipelinerl_jax.pipeline import determinism

            determinism.set_xla_flags()  # before JAX starts its backends
        if cfg.compile_cache:  # before the workdir: a run refused here leaves nothing behind
            from pipelinerl_jax.pipeline.compile_watch import cache_path

            cli.check_dir(
                str(cache_path(cfg.compile_cache)),
                create=not _DRY_RUN.value,
                where=f"--config.compile_cache={cfg.compile_cache}",
            )
        if _WORKDIR.value:  # a model directory given as --workdir: refused, in a dry run too
            from pipelinerl_jax.pipeline.checkpointing import check_own_config

            check_own_config(_WORKDIR.value)
        spec = _check_process_flags(cfg)  # a dry run checks them as the run would
        if _DRY_RUN.value:
            from pipelinerl_jax.dry_run import dry_run

            config_cli.check_workdir(_WORKDIR.value, create=False)
            dry_run(cfg, gpu=gpu, processes=spec)
            return
        config_cli.check_workdir(_WORKDIR.value, create=True)
        if _SPAWN_LOCAL.value:
            from pipelinerl_jax.distributed import roles

            argv = [os.path.abspath(__file__), *sys.argv[1:]]
            sys.exit(
                roles.spawn_local(
                    argv,
                    _SPAWN_LOCAL.value,
                    trainer_processes=cfg.devices.trainer_processes,
                    elastic=_ELASTIC.value,
                )
            )
    except ConfigError as e:
        _fail("config error", e)
    from pipelinerl_jax.pipeline.coordinator import PipelineError
    from pipelinerl_jax.pipeline.runner import run

    try:
        if _NUM_PROCESSES.value > 1:
            _exit_now(_multi_process(cfg))
        run(cfg, _WORKDIR.value)
        # The exit's own garbage collections (several full passes over the ~500k objects a
        # run leaves: JAX's traces, the tokenizer, sympy) took ~1 s of CPU after every run;
        # frozen, they are skipped. atexit handlers and refcount clean-up still run.
        gc.freeze()
    except KeyboardInterrupt:
        interrupts.received()
        print("interrupted: sampler and trainer stopped, reward workers closed", file=sys.stderr)
        _exit_now(130)
    except PipelineError as e:  # a thread failed; its traceback is in the message
        print(f"run failed: {e}", file=sys.stderr)
        _exit_now(1)
    except ConfigError as e:  # found once the devices/model are known (e.g. mesh too large)
        _fail("config error", e)


def _fail(kind: str, message) -> None:
    print(f"{kind}: {message}", file=sys.stderr)
    sys.exit(2)


def _exit_now(code: int) -> None:
    """Exits without interpreter finalization, right after the run's threads stopped.

    Why: a thread that has just finished still runs jaxlib's C++ thread-local destructors,
    which take the GIL; racing them against finalization aborted the process (SIGABRT,
    "FATAL: exception not rethrown") in about half of the Ctrl-C exits. Nothing is lost:
    run() has already closed the checkpointer (waiting for its writes) and the reward workers,
    and metrics.jsonl is written line by line.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _parse_flags(argv):
    """absl's parse, with a bad flag as one line and exit code 2 (absl: usage and exit 1)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail("error", e)


def _help(argv, overrides, asked: str) -> None:
    """--help: this docstring, the flags and every config field (with the --config file's
    values and any overrides applied); --helpfull adds absl's own flags (--verbosity, ...)."""
    argv = [a for a in argv if a not in cli.HELP_FLAGS]
    flags.FLAGS(argv, known_only=True)
    c = config_cli.load_file(_CONFIG.value)
    config_cli.apply_overrides(c, overrides)
    if asked == "--helpfull":
        flag_help = flags.FLAGS.get_help()
    else:
        flag_help = flags.FLAGS.module_help(sys.modules[__name__]) + (
            "\n  --verbosity: absl logging level: -1 warnings (the default here), 0 INFO, "
            "1 debug.\n  (--helpfull lists absl's other flags)"
        )
    source = os.path.relpath(_CONFIG.value) if _CONFIG.value else "the config"
    print(
        f"{__doc__.strip()}\n\nflags:\n{flag_help.rstrip()}\n\n{config_cli.help_text(c, source)}",
        end="",
    )


def launch(argv: list[str]) -> None:
    try:
        rest, overrides = config_cli.split_argv(argv)
        asked = cli.wants_help(rest)
        if asked:
            _help(rest, overrides, asked)
            return
    except ConfigError as e:
        _fail("config error", e)
    except flags.Error as e:
        _fail("error", e)
    app.run(lambda args: main(args, overrides), argv=rest, flags_parser=_parse_flags)


if __name__ == "__main__":
    launch(sys.argv)
