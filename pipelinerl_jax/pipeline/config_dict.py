"""ConfigDict -> RunConfig: the layout of configs/*.py and how it maps onto the dataclasses.

The ConfigDict is what users edit and override from the command line
(`--config.trainer.learning_rate=1e-6`) or from Python (`presets.tiny(steps=2)`: the
ConfigDicts of configs/*.py live in pipelinerl_jax/presets.py); library code only ever sees
the frozen `RunConfig` (pipeline/config.py) built here. Reading checks the dict's shape, with
one-line `ConfigError`s: unknown fields and sections (with the closest name), required fields,
fields derived from others (an error to set), list items of the wrong form. The values are
the dataclasses' to check, each section its own and RunConfig how they fit together.

The layout: the top-level fields (TOP_FIELDS) and one section per entry of SECTIONS.
"""

from __future__ import annotations

import dataclasses

from pipelinerl_jax.data.datasets import DatasetSpec
from pipelinerl_jax.errors import ConfigError, did_you_mean
from pipelinerl_jax.pipeline.config import (
    DataSpec,
    DeviceSpec,
    EnvSpec,
    EvalSpec,
    ModelSpec,
    RewardSpec,
    RunConfig,
    RunSpec,
)
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.train.config import TrainerConfig

# The ConfigDict's sections and the dataclass each one builds ("generation" holds RunSpec's
# sampling fields). A section may be left out: its fields take their defaults.
SECTIONS = {
    "model": ModelSpec,
    "data": DataSpec,
    "generation": RunSpec,
    "sampler": SamplerConfig,
    "reward": RewardSpec,
    "trainer": TrainerConfig,
    "loss": LossConfig,
    "batch": BatchConfig,
    "eval": EvalSpec,
    "env": EnvSpec,
    "devices": DeviceSpec,
}
# Defaults of the RunSpec fields a file may leave out (the dataclass has none for them);
# None: required.
GENERATION_DEFAULTS = {
    "max_prompt_tokens": 256,
    "max_new_tokens": 256,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
}
TOP_DEFAULTS = {
    "seed": 0,
    "mode": "pipeline",
    "max_lag": 0,
    "steps": None,
    "group_size": None,
    "batch_size": None,
    "conventional_steps": 1,
}
TOP_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(RunConfig)
    if f.name not in SECTIONS and f.name not in GENERATION_DEFAULTS
)
# Section fields that from_config_dict derives from other fields: setting them is an error.
DERIVED = {
    "trainer": {"loss": "the loss section"},
    "batch": {
        "max_sequences": "batch_size",
        "max_sequence_len": "generation.max_prompt_tokens + max_new_tokens",
    },
}


def from_config_dict(cfg) -> RunConfig:
    """Validates a ConfigDict (presets.demo_config() sets every field) into a RunConfig."""
    top = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    generation = _section(cfg, "generation")
    _check_keys(top, generation)
    own = _own_fields(top, {**GENERATION_DEFAULTS, **generation})
    # Checked first: trainer, loss and batch derive fields from these.
    run = RunSpec(**{f.name: own[f.name] for f in dataclasses.fields(RunSpec)})

    model = _build(ModelSpec, _section(cfg, "model"), "model")
    data = _build(DataSpec, _section(cfg, "data"), "data")
    sampler = _build(SamplerConfig, _section(cfg, "sampler"), "sampler")
    # loss.temperature is the generation's unless set (RunConfig checks that they are equal).
    loss = _build(LossConfig, {"temperature": run.temperature, **_section(cfg, "loss")}, "loss")
    if sampler.head_dtype is None:  # behaviour logprobs from the head the trainer uses
        sampler = dataclasses.replace(sampler, head_dtype=loss.head_dtype)
    trainer = _build(
        TrainerConfig, {"total_steps": run.steps, **_section(cfg, "trainer")}, "trainer", loss=loss
    )
    batch = _batch(_section(cfg, "batch"), run, trainer)
    devices = _build(DeviceSpec, _section(cfg, "devices"), "devices")
    reward = _build(RewardSpec, _section(cfg, "reward"), "reward")
    eval_spec = _build(EvalSpec, _section(cfg, "eval"), "eval")
    env = _build(EnvSpec, _section(cfg, "env"), "env")
    return RunConfig(
        **own,
        model=model,
        data=data,
        reward=reward,
        devices=devices,
        sampler=sampler,
        trainer=trainer,
        batch=batch,
        eval=eval_spec,
        env=env,
    )


def _check_keys(top: dict, gen: dict) -> None:
    """Unknown top-level fields, sections and generation fields: one line, with a suggestion."""
    known = set(TOP_FIELDS) | set(SECTIONS)
    unknown = sorted(set(top) - known)
    if unknown:
        raise ConfigError(
            f"config.{unknown[0]}: no such field{did_you_mean(unknown[0], known)} "
            "(launch.py --help lists every field)"
        )
    unknown = sorted(set(gen) - set(GENERATION_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"config.generation.{unknown[0]}: no such field"
            f"{did_you_mean(unknown[0], GENERATION_DEFAULTS)}; valid: "
            f"{sorted(GENERATION_DEFAULTS)}"
        )


def _own_fields(top: dict, gen: dict) -> dict:
    """RunConfig's fields that are not sections, from the top level and the generation section
    (`gen`, defaults filled in), as their types."""
    # group_size and batch_size first: missing, they are reported before a missing steps.
    top = {name: _top_value(top, name) for name in ("group_size", "batch_size", *TOP_FIELDS)}
    return dict(
        seed=int(top["seed"]),
        mode=top["mode"],
        max_lag=int(top["max_lag"]),
        steps=int(top["steps"]),
        group_size=int(top["group_size"]),
        batch_size=int(top["batch_size"]),
        conventional_steps=int(top["conventional_steps"]),
        max_new_tokens=int(gen["max_new_tokens"]),
        temperature=float(gen["temperature"]),
        top_p=float(gen["top_p"]),
        top_k=int(gen["top_k"]),
        max_prompt_tokens=int(gen["max_prompt_tokens"]),
        log_every=int(top["log_every"]),
        eval_every=int(top["eval_every"]),
        checkpoint_every=int(top["checkpoint_every"]),
        checkpoint_keep=int(top["checkpoint_keep"]),
        compile_cache=str(top["compile_cache"] or ""),
        trim_host_memory=_flag(top["trim_host_memory"], "trim_host_memory"),
        deterministic=_flag(top["deterministic"], "deterministic"),
        swap_chunks=int(top["swap_chunks"]),
    )


def _top_value(top: dict, name: str):
    """A top-level field's value: the file's, else its default; a required one must be set."""
    if name in top:
        value = top[name]
    elif name in TOP_DEFAULTS:
        value = TOP_DEFAULTS[name]
    else:
        value = next(f.default for f in dataclasses.fields(RunConfig) if f.name == name)
    if value is None and name in TOP_DEFAULTS and TOP_DEFAULTS[name] is None:
        raise ConfigError(f"config.{name} is required (e.g. --config.{name}=...)")
    return value


def _flag(value, name: str) -> bool:
    """A top-level boolean field: True/False (the flag parser makes them from true/false)."""
    if not isinstance(value, bool):
        raise ConfigError(f"config.{name}={value!r} must be true or false")
    return bool(value)


def _section(cfg, name: str) -> dict:
    section = cfg.get(name, None)
    if section is None:
        return {}
    return section.to_dict() if hasattr(section, "to_dict") else dict(section)


def _batch(values: dict, run: RunSpec, trainer: TrainerConfig) -> BatchConfig:
    """The batch section, with its capacity from batch_size, and its row length and row count
    from the generation lengths unless the file sets them."""
    max_len = run.max_prompt_tokens + run.max_new_tokens
    seq_len = int(values.pop("seq_len", 0)) or max_len
    num_rows = int(values.pop("num_rows", 0)) or BatchConfig.rows_for(
        run.batch_size, max_len, seq_len
    )
    # Rows must split over micro-batches (the fsdp split is checked once the mesh exists).
    num_rows = -(-num_rows // trainer.micro_batches) * trainer.micro_batches
    return _build(
        BatchConfig,
        values,
        "batch",
        seq_len=seq_len,
        num_rows=num_rows,
        max_sequences=run.batch_size,
        max_sequence_len=max_len,
    )


def _build(cls, values: dict, where: str, **derived):
    """cls(**values), its list and dict fields converted (_CONVERT) and `derived` added; a
    derived or unknown key in `values` is a one-line error."""
    extra = {name: convert(values.pop(name, None)) for name, convert in _CONVERT.get(where, ())}
    clash = sorted(set(values) & set(derived))
    if clash:
        source = DERIVED.get(where, {}).get(clash[0], "other fields")
        raise ConfigError(f"config.{where}.{clash[0]} is set from {source}; leave it out")
    extra.update(derived)
    fields = {f.name for f in dataclasses.fields(cls)} - set(extra)
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"config.{where}: unknown field(s) {unknown}"
            f"{did_you_mean(unknown[0], fields)}; valid: {sorted(fields)}"
        )
    return cls(**values, **extra)


def _items(d) -> tuple:
    return tuple(sorted((d or {}).items()))


def _few_shot(items) -> tuple:
    """[{question, answer}, ...] (or [(question, answer), ...]) -> ((question, answer), ...)."""
    pairs = []
    for i, item in enumerate(items or ()):
        if isinstance(item, dict) and set(item) == {"question", "answer"}:
            item = (item["question"], item["answer"])
        if (
            not isinstance(item, (tuple, list))
            or len(item) != 2
            or not all(isinstance(x, str) and x.strip() for x in item)
        ):
            raise ConfigError(
                f"config.data.few_shot[{i}] must be dict(question=..., answer=...) "
                f"with non-empty strings, got {item!r}"
            )
        pairs.append(tuple(item))
    return tuple(pairs)


def _dataset_specs(items, where: str) -> tuple:
    """[{path, format, ...}, ...] -> (DatasetSpec, ...); `where` names the field in errors."""
    fields = [f.name for f in dataclasses.fields(DatasetSpec)]
    specs = []
    for i, item in enumerate(items or ()):
        at = f"config.{where}[{i}]"
        if hasattr(item, "to_dict"):  # ml_collections.ConfigDict
            item = item.to_dict()
        if not isinstance(item, dict):
            raise ConfigError(
                f"{at}={item!r}: give an object such as "
                '{"path": "train.jsonl", "format": "gsm8k"}'
            )
        unknown = sorted(set(item) - set(fields))
        if unknown:
            raise ConfigError(
                f"{at}: unknown key {unknown[0]!r}{did_you_mean(unknown[0], fields)}; "
                f"valid: {fields}"
            )
        if "path" not in item:
            raise ConfigError(f"{at}: no path; give the file, folder or glob to read")
        for key, value in item.items():
            optional = key not in ("path", "format")
            if not (isinstance(value, str) and value) and not (optional and value is None):
                raise ConfigError(f"{at}.{key}={value!r}: give a non-empty string")
        specs.append(DatasetSpec(**item))
    return tuple(specs)


# The section fields a ConfigDict holds as dicts or lists, in the order they are converted
# (a field left out converts from None to its default). They are set by the conversion, so a
# section's list of valid fields leaves them out.
_CONVERT = {
    "model": (("init", _items), ("lora", _items)),
    "data": (
        ("task_options", _items),
        ("few_shot", _few_shot),
        ("datasets", lambda items: _dataset_specs(items, "data.datasets")),
    ),
    "reward": (("table_options", _items),),
    "eval": (("datasets", lambda items: _dataset_specs(items, "eval.datasets")),),
    "env": (("options", _items),),
}
