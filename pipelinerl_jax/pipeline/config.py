"""The run configuration: frozen dataclasses that check themselves when built.

Library code only ever sees a `RunConfig`: the run's own fields (`RunSpec`: mode, sizes,
steps, sampling) and one section per part (model, data, reward, devices, sampler, trainer,
batch, eval, env; the env section, EnvSpec, in env_spec.py). Each section checks its own fields in `__post_init__` (SamplerConfig,
TrainerConfig, LossConfig and BatchConfig in their own modules likewise), and `RunConfig`
checks how the sections fit together, so every check that can fail does so at construction,
before any compilation, with a one-line `ConfigError` naming the field and the fix.

pipeline/config_dict.py builds a RunConfig from the ConfigDict users edit (configs/*.py and
command-line overrides). Each field's meaning is the `#` comment beside it in its dataclass
(config_schema.py reads them for `launch.py --help`), so a new field needs one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipelinerl_jax.data.prompts import TEMPLATES
from pipelinerl_jax.data.tasks import TASKS
from pipelinerl_jax.errors import ConfigError, did_you_mean
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.lora import lora_config
from pipelinerl_jax.pipeline.env_spec import EnvSpec
from pipelinerl_jax.rewards.tables import get_reward_table
from pipelinerl_jax.rl.config import BatchConfig
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sequence import SamplingParams
from pipelinerl_jax.train.config import TrainerConfig

MODES = ("pipeline", "conventional")
# The ModelConfig fields model.init may set: the dtypes and remat come from the model section
# itself (pipeline.runner.model_config).
INIT_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig)) - {
    "param_dtype",
    "compute_dtype",
    "remat",
    "remat_policy",
    "lora",
}


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
    lora: tuple = ()  # a dict {rank, alpha, targets}: train LoRA adapters on a frozen base
    #   (models/lora.py; docs/lora.md); empty or rank 0: full fine-tuning
    lora_init: str = ""  # a PEFT adapter directory to start the adapters from (its rank,
    #   alpha and targets unless model.lora sets them, which must then agree)

    def __post_init__(self):
        lora_config(dict(self.lora))  # a bad rank, alpha or target: one line now
        if self.lora_init and not Path(self.lora_init, "adapter_config.json").is_file():
            raise ConfigError(
                f"config.model.lora_init={self.lora_init!r}: no adapter_config.json there; give "
                "a directory PEFT's save_pretrained (or export --peft_out) wrote"
            )
        if self.remat_policy != "attention" and not self.remat:
            raise ConfigError(
                f"config.model.remat_policy={self.remat_policy!r} applies only to a "
                "rematerialised step; set config.model.remat=True too"
            )
        if not self.hf_dir and not self.init:
            raise ConfigError(
                "config.model: set model.hf_dir to a Hugging Face directory or "
                "model.init to the fields of a fresh decoder"
            )
        if self.hf_dir and self.init:
            # The loaded model's shape is its config.json's: init would be ignored.
            raise ConfigError(
                f"config.model.init is for a fresh model, and model.hf_dir={self.hf_dir} loads "
                "one shaped by its config.json: add --config.model.init={} (or leave hf_dir out)"
            )
        unknown = sorted(set(dict(self.init)) - INIT_FIELDS)
        if unknown:
            raise ConfigError(
                f"config.model.init.{unknown[0]}: no such ModelConfig field"
                f"{did_you_mean(unknown[0], INIT_FIELDS)}; valid: {sorted(INIT_FIELDS)}"
            )


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

    def __post_init__(self):
        if self.prompt_template not in TEMPLATES:
            raise ConfigError(
                f"config.data.prompt_template={self.prompt_template!r}: use one of {TEMPLATES}"
                f"{did_you_mean(str(self.prompt_template), TEMPLATES)}"
            )
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError(
                f"config.data.system_prompt={self.system_prompt!r}: give text, '' for none or "
                "null for the paper's"
            )
        if not self.task and not self.datasets:
            raise ConfigError(
                "config.data: set data.task to a built-in task or data.datasets to dataset files"
            )
        if self.task and self.datasets:
            # The task would win and the files be left unread, in silence.
            raise ConfigError(
                f"config.data: data.task={self.task!r} and data.datasets are both set, and a "
                "run draws from one: add --config.data.task= (empty) to train on the files, or "
                "drop data.datasets"
            )
        if not self.task:
            return
        if self.task not in TASKS:
            raise ConfigError(
                f"config.data.task={self.task!r} is unknown; choose one of {sorted(TASKS)}"
            )
        prompted = [f"data.{f}" for f in ("few_shot", "system_prompt") if getattr(self, f)]
        if prompted and not TASKS[self.task].text_task:
            # A character task's prompt is its bare question, in its own tokenizer.
            raise ConfigError(
                f"config.{prompted[0]} does not apply to data.task={self.task}, a character "
                "task whose prompt is the bare question: leave it out, or train a text task"
            )
        options = {f.name for f in dataclasses.fields(TASKS[self.task])}
        unknown = sorted(set(dict(self.task_options)) - options)
        # A task with an options_field (reasoning_gym) takes the dataset's own options flat:
        # make_task folds them into that field and the dataset names a bad one.
        if unknown and not getattr(TASKS[self.task], "options_field", None):
            raise ConfigError(
                f"config.data.task_options.{unknown[0]}: task {self.task} has "
                f"no such option{did_you_mean(unknown[0], options)}; valid: "
                f"{sorted(options)}"
            )


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """How completions are scored: the reward function, its table of coefficients, workers."""

    fn: str = "task"  # "task", "math" or "module.path:callable"
    table: str = "pure_success"  # rewards.tables name
    table_options: tuple = ()  # a dict of coefficient overrides of the table, e.g.
    #   {"format_weight": 0.3}
    workers: int = 0  # 0: score in the sampler thread (cheap rewards only)
    timeout_s: float = 5.0  # seconds per answer before its reward counts as an error

    def __post_init__(self):
        get_reward_table(self.table, **dict(self.table_options))  # a bad name or option
        if self.workers < 0 or not 0 < self.timeout_s < float("inf"):
            raise ConfigError(
                f"config.reward: workers={self.workers} must be >= 0 (0: in the sampler "
                f"thread) and timeout_s={self.timeout_s} finite and > 0"
            )
        if self.workers == 0 and self.timeout_s != RewardSpec.timeout_s:
            raise ConfigError(
                f"config.reward.timeout_s={self.timeout_s} applies only with reward.workers >= "
                "1: reward.workers=0 scores in the sampler thread, with no time limit; set "
                "reward.workers or leave timeout_s out"
            )


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """How local devices split into the sampler mesh and the trainer mesh."""

    sampler: float = 0.5  # a count (>= 1) or a fraction (< 1) of the devices
    trainer_tp: int = 1  # tensor-parallel degree inside the trainer mesh
    sampler_tp: int = 1  # tensor-parallel degree inside the sampler mesh (the
    #   rest of its devices split the slots data-parallel)
    trainer_processes: int = 1  # with --num_processes: how many processes train, one mesh
    #   over all their trainer devices (the rest sample, each on all its local devices)

    def __post_init__(self):
        if self.sampler <= 0 or self.trainer_tp < 1 or self.sampler_tp < 1:
            raise ConfigError(
                f"config.devices.sampler={self.sampler} must be > 0 (a count or a "
                f"fraction), devices.trainer_tp={self.trainer_tp} and "
                f"devices.sampler_tp={self.sampler_tp} >= 1"
            )


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Periodic evaluation on held-out problems (never trained on; lag accounting untouched).

    RunConfig checks num_problems and k, with eval_every (one message for the three)."""

    num_problems: int = 64  # held-out problems per evaluation
    k: int = 1  # attempts per problem (avg@k, pass@k)
    greedy: bool = True  # greedy decoding; else the run's sampling settings
    datasets: tuple = ()  # held-out files, as data.datasets; default: held-out
    #   problems of data.task
    at_start: bool = False  # also evaluate the starting policy (step 0) of a fresh run


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The run's shape: mode, sizes, steps and sampling (the ConfigDict's top level and its
    generation section). The trainer, loss and batch sections derive fields from it, so it is
    checked first; RunConfig adds the sections and the rest of the top level."""

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

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"config.mode={self.mode!r}; use one of {MODES}")
        group_size, batch_size = self.group_size, self.batch_size
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
        if self.mode == "pipeline" and self.max_lag < 0:
            raise ConfigError(
                f"config.max_lag={self.max_lag} must be >= 0 (0 = strictly on-policy)"
            )
        if self.mode == "conventional" and self.conventional_steps < 1:
            raise ConfigError(f"config.conventional_steps={self.conventional_steps} must be >= 1")
        if self.steps < 1:
            raise ConfigError(f"config.steps={self.steps} must be >= 1")
        if not self.temperature > 0:
            raise ConfigError(
                f"generation.temperature={self.temperature} must be > 0: RL samples, and "
                "the trainer divides logits by it"
            )
        # What the sampler would refuse of every request, said before the run starts.
        error = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
        ).error()
        if error:
            raise ConfigError(f"generation.{error}")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"generation.max_prompt_tokens={self.max_prompt_tokens} must be >= 1")

    @property
    def groups_per_step(self) -> int:
        return self.batch_size // self.group_size


@dataclasses.dataclass(frozen=True)
class RunConfig(RunSpec):
    """A whole run: its own fields (RunSpec), its sections, and how the two fit together."""

    model: ModelSpec
    data: DataSpec
    reward: RewardSpec
    devices: DeviceSpec
    sampler: SamplerConfig
    trainer: TrainerConfig
    batch: BatchConfig
    eval: EvalSpec = EvalSpec()
    env: EnvSpec = EnvSpec()
    log_every: int = 10  # a console line every N steps (0: none); metrics.jsonl
    #   gets every step
    eval_every: int = 0  # held-out evaluation every N steps and at the end (0: never)
    checkpoint_every: int = 0  # steps between checkpoints under --workdir, plus one at
    #   the end (0: none)
    checkpoint_keep: int = 3  # newest checkpoints kept
    compile_cache: str = "auto"  # JAX's persistent compilation cache: "auto" (the user's
    #   cache dir, compile_watch.default_cache_dir), a path,
    #   or "" (off)
    trim_host_memory: bool = True  # hand free heap pages back to the kernel before each
    #   train step (glibc_malloc.release): a lower, steady peak RSS
    deterministic: bool = False  # pipeline mode replays bit for bit from the seed: swaps
    #   at chunk boundaries fixed by step counts (pipeline/determinism.py)
    swap_chunks: int = 0  # deterministic: decode chunks between two swaps (0: derived
    #   from the batch, slots and max_new_tokens)

    def __post_init__(self):
        super().__post_init__()
        self.check_sections_fit()

    def check_sections_fit(self) -> None:
        """The checks that need two sections (or a section and the run's own fields); each
        section has checked its own fields already."""
        wanted = getattr(TASKS.get(self.data.task), "reward_fn", None)
        if wanted and self.reward.fn == "task":
            # The default reward would pay text partial credit against the gold answer.
            raise ConfigError(
                f"config.data.task={self.data.task} is scored by reward.fn={wanted}, not "
                f"reward.fn=task; set --config.reward.fn={wanted}"
            )
        sampler, length = self.sampler, self.max_prompt_tokens + self.max_new_tokens
        if length > sampler.max_seq_len:
            raise ConfigError(
                f"generation.max_prompt_tokens={self.max_prompt_tokens} + max_new_tokens="
                f"{self.max_new_tokens} exceed sampler.max_seq_len={sampler.max_seq_len}; raise "
                "sampler.max_seq_len"
            )
        if self.group_size > sampler.num_slots:
            raise ConfigError(
                f"config.group_size={self.group_size} exceeds sampler.num_slots="
                f"{sampler.num_slots}: a group's attempts must fit in the slots"
            )
        if self.trainer.loss.temperature != self.temperature:
            raise ConfigError(
                f"loss.temperature={self.trainer.loss.temperature} differs from "
                f"generation.temperature={self.temperature}; importance ratios need the "
                "same one (leave loss.temperature unset)"
            )
        self.check_deterministic()
        self.env.check_fits(self.data, self.max_new_tokens)
        seeds = (self.seed, self.data.shuffle_seed, self.sampler.seed)
        if min(seeds) < 0 or max(self.seed + s for s in seeds[1:]) >= 2**32:
            raise ConfigError(
                f"config.seed={self.seed}, data.shuffle_seed={self.data.shuffle_seed} and "
                f"sampler.seed={self.sampler.seed} must be >= 0, and each of the last two plus "
                "config.seed < 2**32 (they are the prompt order's and sampling's seeds)"
            )
        for name in ("log_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be >= 0 (0: none)")
        if self.checkpoint_keep < 1:
            raise ConfigError(
                f"config.checkpoint_keep={self.checkpoint_keep} must be >= 1 (the newest "
                "checkpoints kept)"
            )
        if self.eval_every < 0 or self.eval.num_problems < 1 or self.eval.k < 1:
            raise ConfigError(
                f"config.eval_every={self.eval_every} must be >= 0 (0: never), "
                f"eval.num_problems={self.eval.num_problems} and eval.k={self.eval.k} "
                ">= 1"
            )
        if self.eval_every and not self.data.task and not self.eval.datasets:
            raise ConfigError(
                "config.eval_every needs eval.datasets (held-out files) when training on "
                "data.datasets"
            )

    def check_deterministic(self) -> None:
        """config.deterministic covers what this process decides alone (pipeline/determinism.py)."""
        if self.swap_chunks < 0:
            raise ConfigError(f"config.swap_chunks={self.swap_chunks} must be >= 0 (0: derived)")
        if not self.deterministic:
            if self.swap_chunks:
                raise ConfigError(
                    f"config.swap_chunks={self.swap_chunks} only applies with "
                    "config.deterministic=true; set both, or leave swap_chunks out"
                )
            return
        if self.mode != "pipeline":
            raise ConfigError(
                f"config.deterministic applies to mode=pipeline; mode={self.mode} replays "
                "exactly already (every round's tokens carry one version): leave it out"
            )
        if self.env.name:
            raise ConfigError(
                f"config.deterministic with config.env.name={self.env.name!r}: an "
                "environment answers when it answers, so episodes resume at chunks fixed by "
                "timing; drop one of the two"
            )


def as_dict(value: Any) -> Any:
    """RunConfig -> plain JSON-able dict (saved beside checkpoints, compared on resume)."""
    if dataclasses.is_dataclass(value):
        return {f.name: as_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [as_dict(v) for v in value]
    return value
