"""The pipeline: a sampler thread and a trainer thread, weights swapped between decode chunks.

    from pipelinerl_jax import pipeline, presets
    summary = pipeline.run(presets.tiny(steps=2), "/tmp/run")

`run` is runner.py's, `build` and `Components` are components.py's (see their docstrings);
`Coordinator` drives any `sampler.protocol.Sampler` (coordinator.py). They load on first use,
so importing a module of the package (admission, groups) does not build the trainer's and the
sampler's stacks.

- runner.py         execute a run: the threads, checkpoints, metrics, the run summary
- components.py     build a run's parts from a RunConfig: devices, model, trainer, sampler, data
- coordinator.py    the sampler and trainer threads and their hand-offs
- admission.py      lag control: which groups may start, which each step trains
- groups.py         a prompt's attempts from submission to a scored training group
- weights.py        asynchronous weight publication to the sampler
- checkpointing.py  resume, the save schedule, Ctrl-C, the curves
- diagnostics.py    why a reward is what it is: statuses, warnings, sampled completions
- summary.py        the run summary and its closing line
- memory.py         the start-up memory estimate and its one-line refusal
- host_memory.py    this process's peak RSS and the memory still available
"""

_EXPORTS = {
    "run": "runner",
    "build": "components",
    "Components": "components",
    "Coordinator": "coordinator",
    "PipelineError": "coordinator",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
