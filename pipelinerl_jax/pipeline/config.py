"""Run configuration: an ml_collections ConfigDict (configs/*.py) -> frozen dataclasses.

The ConfigDict is what users edit and override from the command line
(`--config.trainer.learning_rate=1e-6`) or from Python (`presets.tiny(steps=2)`: the
ConfigDicts of configs/*.py live in pipelinerl_jax/presets.py); library code only ever sees
the frozen `RunConfig` built here. Every check that can fail does so here, before any
compilation, with a one-line `ConfigError` naming the field and the fix.

The ConfigDict's layout: the top-level fields (TOP_FIELDS) and one section per entry of
SECTIONS. Each field's meaning is the `#` comment beside it in its dataclass (config_schema.py
reads them for `launch.py --help`), so a new field needs one.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from pipelinerl_jax.data.datasets import DatasetSpec
from pipelinerl_jax.data.tasks import TASKS
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.rewards.tables import get_reward_table
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.train.config import TrainerConfig

MODES = ("pipeline", "conventional")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where the policy comes from: a Hugging Face directory, or a fresh tiny decoder."""

    hf_dir: str = ""  # load config.json + safetensors from here when set
    param_dtype: str = "float32"  # "float32" | "bfloat16": params, optimizer updates
    compute_dtype: str = "float32"  # "float32" | "bfloat16": activations (logits stay f32)
    remat: bool = False  # recompute each layer in the backward pass: activation
    #   memory of one layer instead of all (docs/real_model.md#memory)
    remat_policy: str = "attention"  # with remat, what each layer keeps: "attention" (least
    #   memory) or "matmuls" (no matmul recomputed: faster, more memory; docs/real_model.md#memory)
    init: tuple = ()  # a dict of ModelConfig fields: a fresh, random model


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The prompts: a built-in procedural task, or dataset files with a prompt template."""

    task: str = "reverse_digits"  # a name in data.tasks.TASKS; "" to use `datasets`
    task_options: tuple = ()  # a dict of the task's options (make_task's arguments)
    datasets: tuple = ()  # [{path, format, name, question_field, answer_field}]:
    #   JSONL/Parquet files (data.datasets.DatasetSpec)
    prompt_template: str = "chat"  # "chat" | "plain" (dataset prompts only)
    system_prompt: str | None = None  # None: the paper's ("Please reason step by step, ...");
    #   "": no system message
    few_shot: tuple = ()  # [{question, answer}, ...]: worked examples shown before
    #   each question (chat: earlier turns)
    shuffle_seed: int = 0  # the prompt order's seed (added to the run's seed)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """How completions are scored: the reward function, its table of coefficients, workers."""

    fn: str = "task"  # "task", "math" or "module.path:callable"
    table: str = "pure_success"  # rewards.tables name
    table_options: tuple = ()  # a dict of coefficient overrides of the table, e.g.
    #   {"format_weight": 0.3}
    workers: int = 0  # 0: score in the sampler thread (cheap rewards only)
    timeout_s: float = 5.0  # seconds per answer before its reward counts as an error


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """How local devices split into the sampler mesh and the trainer mesh."""

    sampler: float = 0.5  # a count (>= 1) or a fraction (< 1) of the devices
    trainer_tp: int = 1  # tensor-parallel degree inside the trainer mesh
    sampler_tp: int = 1  # tensor-parallel degree inside the sampler mesh (the
    #   rest of its devices split the slots data-parallel)
    trainer_processes: int = 1  # with --num_processes: how many processes train, one mesh
    #   over all their trainer devices (the rest sample, each on all its local devices)


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Periodic evaluation on held-out problems (never trained on; lag accounting untouched)."""

    num_problems: int = 64  # held-out problems per evaluation
    k: int = 1  # attempts per problem (avg@k, pass@k)
    greedy: bool = True  # greedy decoding; else the run's sampling settings
    datasets: tuple = ()  # held-out files, as data.datasets; default: held-out
    #   problems of data.task
    at_start: bool = False  # also evaluate the starting policy (step 0) of a fresh run


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int  # model init, prompt order and sampling seeds derive from it
    mode: str  # "pipeline" | "conventional"
    max_lag: int  # pipeline: lag bound in optimizer steps
    steps: int  # optimizer steps
    group_size: int  # G attempts per prompt
    batch_size: int  # sequences per optimizer step
    conventional_steps: int  # conventional mode: steps per generation round
    max_new_tokens: int  # completion tokens per attempt, at most
    temperature: float  # sampling temperature (> 0: RL samples)
    top_p: float  # nucleus sampling mass; 1: off
    top_k: int  # top-k sampling; 0: off
    max_prompt_tokens: int  # prompt tokens budgeted per sequence (with max_new_tokens:
    #   the sampler's context and the packed row length)
    model: ModelSpec
    data: DataSpec
    reward: RewardSpec
    devices: DeviceSpec
    sampler: SamplerConfig
    trainer: TrainerConfig
    batch: BatchConfig
    eval: EvalSpec = EvalSpec()
    log_every: int = 10  # a console line every N steps (0: none); metrics.jsonl
    #   gets every step
    eval_every: int = 0  # held-out evaluation every N steps and at the end (0: never)
    checkpoint_every: int = 0  # steps between checkpoints under --workdir, plus one at
    #   the end (0: none)
    checkpoint_keep: int = 3  # newest checkpoints kept
    compile_cache: str = "auto"  # JAX's persistent compilation cache: "auto" (the user's
    #   cache dir, compile_watch.default_cache_dir), a path,
    #   or "" (off)

    @property
    def groups_per_step(self) -> int:
        return self.batch_size // self.group_size


# The ConfigDict's sections and the dataclass each one builds ("generation" holds RunConfig's
# sampling fields). A section may be left out: its fields take their defaults.
SECTIONS = {
    "model": ModelSpec,
    "data": DataSpec,
    "generation": RunConfig,
    "sampler": SamplerConfig,
    "reward": RewardSpec,
    "trainer": TrainerConfig,
    "loss": LossConfig,
    "batch": BatchConfig,
    "eval": EvalSpec,
    "devices": DeviceSpec,
}
# Defaults of the RunConfig fields a file may leave out (the dataclass has none for them);
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


def did_you_mean(name: str, choices) -> str:
    """ "; did you mean X?" for the closest of `choices` to `name`, or ""."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


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


def _section(cfg, name: str) -> dict:
    section = cfg.get(name, None)
    if section is None:
        return {}
    return section.to_dict() if hasattr(section, "to_dict") else dict(section)


def _build(cls, values: dict, where: str, **extra):
    """cls(**values) with unknown keys reported as a one-line error."""
    fields = {f.name for f in dataclasses.fields(cls)} - set(extra)
    clash = sorted(set(values) & set(extra))
    if clash:
        derived = DERIVED.get(where, {}).get(clash[0], "other fields")
        raise ConfigError(f"config.{where}.{clash[0]} is set from {derived}; leave it out")
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"config.{where}: unknown field(s) {unknown}"
            f"{did_you_mean(unknown[0], fields)}; valid: {sorted(fields)}"
        )
    return cls(**values, **extra)


def _items(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def from_config_dict(cfg) -> RunConfig:
    """Validates a ConfigDict (presets.demo_config() sets every field) into a RunConfig."""
    top = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    _check_keys(top, _section(cfg, "generation"))
    mode = _top_value(top, "mode")
    if mode not in MODES:
        raise ConfigError(f"config.mode={mode!r}; use one of {MODES}")
    group_size, batch_size = int(_top_value(top, "group_size")), int(_top_value(top, "batch_size"))
    if group_size < 1 or batch_size < 1:
        raise ConfigError(
            f"config.group_size={group_size} and config.batch_size={batch_size} must be >= 1"
        )
    if batch_size % group_size:
        raise ConfigError(
            f"config.batch_size={batch_size} is not divisible by config.group_size="
            f"{group_size}; a step trains whole groups (try "
            f"{batch_size // group_size * group_size or group_size})"
        )
    max_lag = int(_top_value(top, "max_lag"))
    conventional_steps = int(_top_value(top, "conventional_steps"))
    if mode == "pipeline" and max_lag < 0:
        raise ConfigError(f"config.max_lag={max_lag} must be >= 0 (0 = strictly on-policy)")
    if mode == "conventional" and conventional_steps < 1:
        raise ConfigError(f"config.conventional_steps={conventional_steps} must be >= 1")
    steps = int(_top_value(top, "steps"))
    if steps < 1:
        raise ConfigError(f"config.steps={steps} must be >= 1")

    model = _section(cfg, "model")
    init = model.pop("init", {}) or {}
    model_spec = _build(ModelSpec, model, "model", init=_items(init))
    if model_spec.remat_policy != "attention" and not model_spec.remat:
        raise ConfigError(
            f"config.model.remat_policy={model_spec.remat_policy!r} applies only to a "
            "rematerialised step; set config.model.remat=True too"
        )
    if not model_spec.hf_dir and not init:
        raise ConfigError(
            "config.model: set model.hf_dir to a Hugging Face directory or "
            "model.init to the fields of a fresh decoder"
        )

    # The dtypes and remat come from the model section itself (pipeline.runner.model_config).
    arch = {f.name for f in dataclasses.fields(ModelConfig)} - {
        "param_dtype",
        "compute_dtype",
        "remat",
        "remat_policy",
    }
    unknown = sorted(set(init) - arch)
    if unknown:
        raise ConfigError(
            f"config.model.init.{unknown[0]}: no such ModelConfig field"
            f"{did_you_mean(unknown[0], arch)}; valid: {sorted(arch)}"
        )

    data = _section(cfg, "data")
    task_options = data.pop("task_options", {}) or {}
    datasets = tuple(data.pop("datasets", ()) or ())
    few_shot = _few_shot(data.pop("few_shot", ()) or ())
    data_spec = _build(
        DataSpec,
        data,
        "data",
        task_options=_items(task_options),
        datasets=_dataset_specs(datasets),
        few_shot=few_shot,
    )
    if not data_spec.task and not data_spec.datasets:
        raise ConfigError(
            "config.data: set data.task to a built-in task or data.datasets to dataset files"
        )
    if data_spec.task:
        if data_spec.task not in TASKS:
            raise ConfigError(
                f"config.data.task={data_spec.task!r} is unknown; choose one of {sorted(TASKS)}"
            )
        options = {f.name for f in dataclasses.fields(TASKS[data_spec.task])}
        unknown = sorted(set(task_options) - options)
        if unknown:
            raise ConfigError(
                f"config.data.task_options.{unknown[0]}: task {data_spec.task} has "
                f"no such option{did_you_mean(unknown[0], options)}; valid: "
                f"{sorted(options)}"
            )

    gen = _section(cfg, "generation")
    gen = {**GENERATION_DEFAULTS, **gen}
    max_new_tokens = int(gen["max_new_tokens"])
    max_prompt_tokens = int(gen["max_prompt_tokens"])
    sampler_cfg = _build(SamplerConfig, _section(cfg, "sampler"), "sampler")
    sampler_cfg.validate()
    if max_prompt_tokens + max_new_tokens > sampler_cfg.max_seq_len:
        raise ConfigError(
            f"generation.max_prompt_tokens={max_prompt_tokens} + max_new_tokens="
            f"{max_new_tokens} exceed sampler.max_seq_len={sampler_cfg.max_seq_len}; raise "
            "sampler.max_seq_len"
        )
    if group_size > sampler_cfg.num_slots:
        raise ConfigError(
            f"config.group_size={group_size} exceeds sampler.num_slots="
            f"{sampler_cfg.num_slots}: a group's attempts must fit in the slots"
        )

    temperature = float(gen["temperature"])
    if not temperature > 0:
        raise ConfigError(
            f"generation.temperature={temperature} must be > 0: RL samples, and "
            "the trainer divides logits by it"
        )
    loss_values = _section(cfg, "loss")
    if loss_values.setdefault("temperature", temperature) != temperature:
        raise ConfigError(
            f"loss.temperature={loss_values['temperature']} differs from "
            f"generation.temperature={temperature}; importance ratios need the "
            "same one (leave loss.temperature unset)"
        )
    loss = _build(LossConfig, loss_values, "loss")
    if sampler_cfg.head_dtype is None:  # behaviour logprobs from the head the trainer uses
        sampler_cfg = dataclasses.replace(sampler_cfg, head_dtype=loss.head_dtype)
    trainer_values = _section(cfg, "trainer")
    trainer_values.setdefault("total_steps", steps)
    trainer = _build(TrainerConfig, trainer_values, "trainer", loss=loss)

    batch_values = _section(cfg, "batch")
    seq_len = int(batch_values.pop("seq_len", 0)) or max_prompt_tokens + max_new_tokens
    max_len = max_prompt_tokens + max_new_tokens
    num_rows = int(batch_values.pop("num_rows", 0)) or BatchConfig.rows_for(
        batch_size, max_len, seq_len
    )
    # Rows must split over micro-batches (the fsdp split is checked once the mesh exists).
    num_rows = -(-num_rows // trainer.micro_batches) * trainer.micro_batches
    batch = _build(
        BatchConfig,
        batch_values,
        "batch",
        seq_len=seq_len,
        num_rows=num_rows,
        max_sequences=batch_size,
        max_sequence_len=max_len,
    )

    dev = _build(DeviceSpec, _section(cfg, "devices"), "devices")
    if dev.sampler <= 0 or dev.trainer_tp < 1 or dev.sampler_tp < 1:
        raise ConfigError(
            f"config.devices.sampler={dev.sampler} must be > 0 (a count or a "
            f"fraction), devices.trainer_tp={dev.trainer_tp} and "
            f"devices.sampler_tp={dev.sampler_tp} >= 1"
        )
    reward_values = _section(cfg, "reward")
    table_options = reward_values.pop("table_options", {}) or {}
    reward = _build(RewardSpec, reward_values, "reward", table_options=_items(table_options))

    get_reward_table(reward.table, **table_options)  # one-line error for a bad name/option
    eval_values = _section(cfg, "eval")
    eval_datasets = _dataset_specs(eval_values.pop("datasets", ()) or ())
    eval_spec = _build(EvalSpec, eval_values, "eval", datasets=eval_datasets)
    eval_every = int(_top_value(top, "eval_every"))
    if eval_every < 0 or eval_spec.num_problems < 1 or eval_spec.k < 1:
        raise ConfigError(
            f"config.eval_every={eval_every} must be >= 0 (0: never), "
            f"eval.num_problems={eval_spec.num_problems} and eval.k={eval_spec.k} "
            ">= 1"
        )
    if eval_every and not data_spec.task and not eval_spec.datasets:
        raise ConfigError(
            "config.eval_every needs eval.datasets (held-out files) when training on data.datasets"
        )

    return RunConfig(
        seed=int(_top_value(top, "seed")),
        mode=mode,
        max_lag=max_lag,
        steps=steps,
        group_size=group_size,
        batch_size=batch_size,
        conventional_steps=conventional_steps,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=float(gen["top_p"]),
        top_k=int(gen["top_k"]),
        max_prompt_tokens=max_prompt_tokens,
        model=model_spec,
        data=data_spec,
        reward=reward,
        devices=dev,
        sampler=sampler_cfg,
        trainer=trainer,
        batch=batch,
        eval=eval_spec,
        log_every=int(_top_value(top, "log_every")),
        eval_every=eval_every,
        checkpoint_every=int(_top_value(top, "checkpoint_every")),
        checkpoint_keep=int(_top_value(top, "checkpoint_keep")),
        compile_cache=str(_top_value(top, "compile_cache") or ""),
    )


def _few_shot(items) -> tuple:
    """[{question, answer}, ...] (or [(question, answer), ...]) -> ((question, answer), ...)."""
    pairs = []
    for i, item in enumerate(items):
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


def _dataset_specs(items) -> tuple:

    specs = []
    for i, item in enumerate(items):
        item = dict(item)
        try:
            specs.append(DatasetSpec(**item))
        except TypeError as e:
            raise ConfigError(f"config.data.datasets[{i}]: {e}") from None
    return tuple(specs)


def as_dict(value: Any) -> Any:
    """RunConfig -> plain JSON-able dict (saved beside checkpoints, compared on resume)."""
    if dataclasses.is_dataclass(value):
        return {f.name: as_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [as_dict(v) for v in value]
    return value
