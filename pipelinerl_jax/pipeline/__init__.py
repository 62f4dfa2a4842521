"""The pipeline: a sampler thread and a trainer thread, weights swapped between decode chunks.

    from pipelinerl_jax import pipeline, presets
    summary = pipeline.run(presets.tiny(steps=2), "/tmp/run")

`run`, `build` and `Components` are runner.py's (see its docstring); `Coordinator` drives any
`sampler.protocol.Sampler` (coordinator.py). They load on first use, so importing a light
module of the package (admission, groups) does not import JAX and the trainer.
"""

_EXPORTS = {
    "run": "runner",
    "build": "runner",
    "Components": "runner",
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
