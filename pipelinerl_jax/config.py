"""Run configuration: an ml_collections ConfigDict (configs/*.py) -> frozen dataclasses.

The ConfigDict is what users edit and override from the command line
(`--config.trainer.learning_rate=1e-6`); library code only ever sees the frozen `RunConfig`
built here. Every check that can fail does so here, before any compilation, with a one-line
`ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.sampler.sampler import SamplerConfig
from pipelinerl_jax.trainer import TrainerConfig

MODES = ("pipeline", "conventional")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where the policy comes from: a Hugging Face directory, or a fresh tiny decoder."""
    hf_dir: str = ""                  # load config.json + safetensors from here when set
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False               # recompute each layer in the backward pass: activation
                                      #   memory of one layer instead of all (README: memory)
    init: tuple = ()                  # ModelConfig fields for a fresh model (sorted items)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The prompts: a built-in procedural task, or dataset files with a prompt template."""
    task: str = "reverse_digits"      # a name in data.tasks.TASKS; "" to use `datasets`
    task_options: tuple = ()          # sorted (name, value) items for make_task
    datasets: tuple = ()              # data.datasets.DatasetSpec
    prompt_template: str = "chat"     # "chat" | "plain" (dataset prompts only)
    system_prompt: str | None = None  # None: the paper's ("Please reason step by step, ...");
                                      #   "": no system message
    few_shot: tuple = ()              # ((question, answer), ...): worked examples shown before
                                      #   each question (chat: earlier turns)
    shuffle_seed: int = 0


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    fn: str = "task"                  # "task", "math" or "module.path:callable"
    table: str = "pure_success"       # rewards.tables name
    table_options: tuple = ()         # sorted (name, value) coefficient overrides of the table,
                                      #   e.g. {"format_weight": 0.3}
    workers: int = 0                  # 0: score in the sampler thread (cheap rewards only)
    timeout_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """How local devices split into the sampler mesh and the trainer mesh."""
    sampler: float = 0.5              # a count (>= 1) or a fraction (< 1) of the devices
    trainer_tp: int = 1               # tensor-parallel degree inside the trainer mesh
    sampler_tp: int = 1               # tensor-parallel degree inside the sampler mesh (the
                                      #   rest of its devices split the slots data-parallel)


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Periodic evaluation on held-out problems (never trained on; lag accounting untouched)."""
    num_problems: int = 64            # held-out problems per evaluation
    k: int = 1                        # attempts per problem (avg@k, pass@k)
    greedy: bool = True               # greedy decoding; else the run's sampling settings
    datasets: tuple = ()              # data.datasets.DatasetSpec; default: held-out task problems
    at_start: bool = False            # also evaluate the starting policy (step 0) of a fresh run


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int
    mode: str                         # "pipeline" | "conventional"
    max_lag: int                      # pipeline: lag bound in optimizer steps
    steps: int                        # optimizer steps
    group_size: int                   # G attempts per prompt
    batch_size: int                   # sequences per optimizer step
    conventional_steps: int           # conventional mode: steps per generation round
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    max_prompt_tokens: int
    model: ModelSpec
    data: DataSpec
    reward: RewardSpec
    devices: DeviceSpec
    sampler: SamplerConfig
    trainer: TrainerConfig
    batch: BatchConfig
    eval: EvalSpec = EvalSpec()
    log_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    compile_cache: str = "auto"       # JAX's persistent compilation cache: "auto" (the user's
                                      #   cache dir, compile_watch.default_cache_dir), a path,
                                      #   or "" (off)

    @property
    def groups_per_step(self) -> int:
        return self.batch_size // self.group_size


def _section(cfg, name: str) -> dict:
    section = cfg.get(name, None)
    if section is None:
        return {}
    return section.to_dict() if hasattr(section, "to_dict") else dict(section)


def _build(cls, values: dict, where: str, **extra):
    """cls(**values) with unknown keys reported as a one-line error."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"config.{where}: unknown field(s) {unknown}; valid: {sorted(fields)}")
    return cls(**values, **extra)


def _items(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def from_config_dict(cfg) -> RunConfig:
    """Validates a ConfigDict (see configs/default.py for every field) into a RunConfig."""
    top = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    mode = top.get("mode", "pipeline")
    if mode not in MODES:
        raise ConfigError(f"config.mode={mode!r}; use one of {MODES}")
    group_size, batch_size = int(top["group_size"]), int(top["batch_size"])
    if group_size < 1 or batch_size < 1:
        raise ConfigError(f"config.group_size={group_size} and config.batch_size={batch_size} "
                          "must be >= 1")
    if batch_size % group_size:
        raise ConfigError(f"config.batch_size={batch_size} is not divisible by config.group_size="
                          f"{group_size}; a step trains whole groups (try "
                          f"{batch_size // group_size * group_size or group_size})")
    max_lag = int(top.get("max_lag", 0))
    conventional_steps = int(top.get("conventional_steps", 1))
    if mode == "pipeline" and max_lag < 0:
        raise ConfigError(f"config.max_lag={max_lag} must be >= 0 (0 = strictly on-policy)")
    if mode == "conventional" and conventional_steps < 1:
        raise ConfigError(f"config.conventional_steps={conventional_steps} must be >= 1")
    steps = int(top["steps"])
    if steps < 1:
        raise ConfigError(f"config.steps={steps} must be >= 1")

    model = _section(cfg, "model")
    init = model.pop("init", {}) or {}
    model_spec = _build(ModelSpec, model, "model", init=_items(init))
    if not model_spec.hf_dir and not init:
        raise ConfigError("config.model: set model.hf_dir to a Hugging Face directory or "
                          "model.init to the fields of a fresh decoder")

    data = _section(cfg, "data")
    task_options = data.pop("task_options", {}) or {}
    datasets = tuple(data.pop("datasets", ()) or ())
    few_shot = _few_shot(data.pop("few_shot", ()) or ())
    data_spec = _build(DataSpec, data, "data", task_options=_items(task_options),
                       datasets=_dataset_specs(datasets), few_shot=few_shot)
    if not data_spec.task and not data_spec.datasets:
        raise ConfigError("config.data: set data.task to a built-in task or data.datasets to "
                          "dataset files")
    if data_spec.task:
        from pipelinerl_jax.data.tasks import TASKS
        if data_spec.task not in TASKS:
            raise ConfigError(f"config.data.task={data_spec.task!r} is unknown; choose one of "
                              f"{sorted(TASKS)}")

    gen = _section(cfg, "generation")
    max_new_tokens = int(gen.get("max_new_tokens", 256))
    max_prompt_tokens = int(gen.get("max_prompt_tokens", 256))
    sampler_cfg = _build(SamplerConfig, _section(cfg, "sampler"), "sampler")
    sampler_cfg.validate()
    if max_prompt_tokens + max_new_tokens > sampler_cfg.max_seq_len:
        raise ConfigError(
            f"generation.max_prompt_tokens={max_prompt_tokens} + max_new_tokens="
            f"{max_new_tokens} exceed sampler.max_seq_len={sampler_cfg.max_seq_len}; raise "
            "sampler.max_seq_len")
    if group_size > sampler_cfg.num_slots:
        raise ConfigError(f"config.group_size={group_size} exceeds sampler.num_slots="
                          f"{sampler_cfg.num_slots}: a group's attempts must fit in the slots")

    temperature = float(gen.get("temperature", 1.0))
    if not temperature > 0:
        raise ConfigError(f"generation.temperature={temperature} must be > 0: RL samples, and "
                          "the trainer divides logits by it")
    loss_values = _section(cfg, "loss")
    if loss_values.setdefault("temperature", temperature) != temperature:
        raise ConfigError(f"loss.temperature={loss_values['temperature']} differs from "
                          f"generation.temperature={temperature}; importance ratios need the "
                          "same one (leave loss.temperature unset)")
    loss = _build(LossConfig, loss_values, "loss")
    trainer_values = _section(cfg, "trainer")
    trainer_values.setdefault("total_steps", steps)
    trainer = _build(TrainerConfig, trainer_values, "trainer", loss=loss)

    batch_values = _section(cfg, "batch")
    seq_len = int(batch_values.pop("seq_len", 0)) or max_prompt_tokens + max_new_tokens
    max_len = max_prompt_tokens + max_new_tokens
    num_rows = int(batch_values.pop("num_rows", 0)) or BatchConfig.rows_for(
        batch_size, max_len, seq_len)
    # Rows must split over micro-batches (the fsdp split is checked once the mesh exists).
    num_rows = -(-num_rows // trainer.micro_batches) * trainer.micro_batches
    batch = _build(BatchConfig, batch_values, "batch", seq_len=seq_len, num_rows=num_rows,
                   max_sequences=batch_size, max_sequence_len=max_len)

    dev = _build(DeviceSpec, _section(cfg, "devices"), "devices")
    if dev.sampler <= 0 or dev.trainer_tp < 1 or dev.sampler_tp < 1:
        raise ConfigError(f"config.devices.sampler={dev.sampler} must be > 0 (a count or a "
                          f"fraction), devices.trainer_tp={dev.trainer_tp} and "
                          f"devices.sampler_tp={dev.sampler_tp} >= 1")
    reward_values = _section(cfg, "reward")
    table_options = reward_values.pop("table_options", {}) or {}
    reward = _build(RewardSpec, reward_values, "reward", table_options=_items(table_options))
    from pipelinerl_jax.rewards.tables import get_reward_table
    get_reward_table(reward.table, **table_options)  # one-line error for a bad name/option
    eval_values = _section(cfg, "eval")
    eval_datasets = _dataset_specs(eval_values.pop("datasets", ()) or ())
    eval_spec = _build(EvalSpec, eval_values, "eval", datasets=eval_datasets)
    eval_every = int(top.get("eval_every", 0))
    if eval_every < 0 or eval_spec.num_problems < 1 or eval_spec.k < 1:
        raise ConfigError(f"config.eval_every={eval_every} must be >= 0 (0: never), "
                          f"eval.num_problems={eval_spec.num_problems} and eval.k={eval_spec.k} "
                          ">= 1")
    if eval_every and not data_spec.task and not eval_spec.datasets:
        raise ConfigError("config.eval_every needs eval.datasets (held-out files) when training "
                          "on data.datasets")

    return RunConfig(
        seed=int(top.get("seed", 0)), mode=mode, max_lag=max_lag, steps=steps,
        group_size=group_size, batch_size=batch_size, conventional_steps=conventional_steps,
        max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=float(gen.get("top_p", 1.0)), top_k=int(gen.get("top_k", 0)),
        max_prompt_tokens=max_prompt_tokens, model=model_spec, data=data_spec, reward=reward,
        devices=dev, sampler=sampler_cfg, trainer=trainer, batch=batch, eval=eval_spec,
        log_every=int(top.get("log_every", 10)), eval_every=eval_every,
        checkpoint_every=int(top.get("checkpoint_every", 0)),
        checkpoint_keep=int(top.get("checkpoint_keep", 3)),
        compile_cache=str(top.get("compile_cache", "auto") or ""))


def _few_shot(items) -> tuple:
    """[{question, answer}, ...] (or [(question, answer), ...]) -> ((question, answer), ...)."""
    pairs = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and set(item) == {"question", "answer"}:
            item = (item["question"], item["answer"])
        if (not isinstance(item, (tuple, list)) or len(item) != 2
                or not all(isinstance(x, str) and x.strip() for x in item)):
            raise ConfigError(f"config.data.few_shot[{i}] must be dict(question=..., answer=...) "
                              f"with non-empty strings, got {item!r}")
        pairs.append(tuple(item))
    return tuple(pairs)


def _dataset_specs(items) -> tuple:
    from pipelinerl_jax.data.datasets import DatasetSpec
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
