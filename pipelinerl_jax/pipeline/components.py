"""A run's parts, built from a RunConfig: device split, meshes, model, trainer, sampler, data.

    c = pipeline.build(cfg)                 # Components: sampler, trainer, state, stream, ...
    c.sampler = MySampler(...)              # any sampler.protocol.Sampler
    summary = pipeline.run(cfg, "/tmp/run", components=c)

`build(cfg)` returns the `Components` that `run(..., components=...)` runs (runner.py), so a
part can be replaced first: `c.sampler` by any `sampler.protocol.Sampler` (the run publishes
weights through its `prepare`), `c.trainer` by anything with the Trainer's `train_step`. The
pieces it is made of serve on their own too: `split_devices`, `model_config` and
`check_memory` are what launch.py --dry_run checks without building anything, and the
distributed roles build their own share (a follower's trainer, a sampler process) from
`build_data`, `build_model` and `sampler_mesh`.

Devices: one device is shared by both roles (JAX serialises their work); with several, the
first `devices.sampler` (a count, or a fraction of them) form the sampler mesh (data × tp:
groups of `devices.sampler_tp` devices split the params tensor-parallel, the groups split the
slots data-parallel) and the rest the trainer mesh (FSDP × TP).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from pipelinerl_jax import sharding
from pipelinerl_jax.data import prompts as prompts_lib
from pipelinerl_jax.data.datasets import PromptStream, load_problems
from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.procedural import ProceduralSource
from pipelinerl_jax.data.prompts import PromptConfig, build_prompt
from pipelinerl_jax.data.tasks import TASKS, CharTokenizer, held_out_problems, make_task
from pipelinerl_jax.envs.codec import EpisodeCodec
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import config_json, decoder, lora, peft_io
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.hf_io import load_hf, read_config
from pipelinerl_jax.models.lora import lora_config
from pipelinerl_jax.models.tokenizer import Tokenizer
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import host_memory, memory
from pipelinerl_jax.pipeline.admission import Admission
from pipelinerl_jax.pipeline.episodes import make_driver
from pipelinerl_jax.pipeline.eval_lib import evaluate_episodes, evaluate_problems
from pipelinerl_jax.rewards.workers import RewardPool
from pipelinerl_jax.sampler.param_view import is_adapters_only
from pipelinerl_jax.sampler.protocol import Sampler
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams
from pipelinerl_jax.train.checkpoint import RunCheckpointer
from pipelinerl_jax.train.trainer import LossFn, Trainer, TrainState, trainer_mesh

# A model's token ids <-> text: a model directory's tokenizer, or a character task's own.
AnyTokenizer = Tokenizer | CharTokenizer
# problem -> its prompt's token ids.
PromptEncoder = Callable[[Problem], list[int]]
# (params, version) -> metrics of held-out problems (eval_lib.evaluate_problems's dict).
Evaluator = Callable[[nnx.State, int], dict]


def split_devices(
    devices: Iterable[jax.Device], spec: config_lib.DeviceSpec
) -> tuple[list[jax.Device], list[jax.Device]]:
    """(sampler devices, trainer devices); one device serves both roles."""
    devices = list(devices)
    n = len(devices)
    if n == 1:
        if spec.sampler_tp != 1 or spec.trainer_tp != 1:
            raise ConfigError(
                f"devices.sampler_tp={spec.sampler_tp} and devices.trainer_tp="
                f"{spec.trainer_tp} need more than the 1 device there is: "
                "set both to 1"
            )
        return devices, devices
    count = int(spec.sampler) if spec.sampler >= 1 else int(round(spec.sampler * n))
    if spec.sampler >= 1 and count != spec.sampler:
        raise ConfigError(f"devices.sampler={spec.sampler}: give a whole count or a fraction < 1")
    if not 1 <= count < n:
        raise ConfigError(
            f"devices.sampler={spec.sampler} leaves {count} of {n} devices for the "
            f"sampler; it needs between 1 and {n - 1} so the trainer keeps one"
        )
    trainer_devices = devices[count:]
    if len(trainer_devices) % spec.trainer_tp:
        raise ConfigError(
            f"devices.trainer_tp={spec.trainer_tp} does not divide the "
            f"{len(trainer_devices)} trainer devices"
        )
    if count % spec.sampler_tp:
        raise ConfigError(
            f"devices.sampler_tp={spec.sampler_tp} does not divide the {count} sampler devices"
        )
    return devices[:count], trainer_devices


def sampler_mesh(devices: Sequence[jax.Device], cfg: config_lib.RunConfig) -> Mesh:
    """(data, tp) mesh over the sampler devices: tp-sized groups split the params, the groups
    split the slots."""
    tp = cfg.devices.sampler_tp
    axes = (cfg.sampler.data_axis, cfg.sampler.tp_axis)
    return sharding.make_mesh((len(devices) // tp, tp), axes, devices)


def build_data(
    cfg: config_lib.RunConfig, *, load_source: bool = True
) -> tuple[AnyTokenizer, Sequence[Problem] | ProceduralSource | None, PromptEncoder]:
    """(tokenizer, problem source, prompt encoder) for the config's data section; without
    `load_source` the source is None (a run given its own prompts reads no files)."""
    data = cfg.data
    if data.task:
        task = make_task(data.task, **dict(data.task_options))
        if not task.text_task:  # a character task: its own tokenizer, the bare question
            tokenizer = task.tokenizer
            encode = lambda problem: tokenizer.encode(problem.question)
            return tokenizer, task.source(), encode
        source = task.source()
    elif load_source:
        source = load_problems(data.datasets, "data.datasets")
    else:
        source = None
    tokenizer = model_tokenizer(cfg, "data.task" if data.task else "data.datasets")
    return tokenizer, source, prompt_encoder(tokenizer, prompt_config(data))


def model_tokenizer(cfg: config_lib.RunConfig, what: str) -> Tokenizer:
    """The tokenizer of model.hf_dir: text prompts need the model's own."""
    if not cfg.model.hf_dir:
        raise _text_needs_model(what)
    return Tokenizer.from_dir(cfg.model.hf_dir)


def check_text_has_model(cfg: config_lib.RunConfig) -> None:
    """Text data (a text task, data.datasets) is tokenized by model.hf_dir's tokenizer: refused
    without one by the dry run, and before a run touches its workdir."""
    data = cfg.data
    if cfg.model.hf_dir:
        return
    if data.task and TASKS[data.task].text_task:
        raise _text_needs_model("data.task")
    if not data.task and data.datasets:
        raise _text_needs_model("data.datasets")


def _text_needs_model(what: str) -> ConfigError:
    return ConfigError(
        f"config.{what} is text: it needs model.hf_dir (its tokenizer and chat template "
        "render the prompts)"
    )


def prompt_config(data: config_lib.DataSpec) -> PromptConfig:
    """The data section's template, system prompt (None: the paper's) and few-shot examples."""
    few_shot = tuple(tuple(pair) for pair in data.few_shot)
    if data.system_prompt is None:
        return PromptConfig(template=data.prompt_template, few_shot=few_shot)
    return PromptConfig(
        template=data.prompt_template, system_prompt=data.system_prompt, few_shot=few_shot
    )


def prompt_encoder(tokenizer: AnyTokenizer, prompt_cfg: PromptConfig) -> PromptEncoder:
    """problem -> prompt token ids through the chat (or plain) template."""

    def encode(problem: Problem) -> list[int]:
        text = build_prompt(problem.question, tokenizer, prompt_cfg)
        return tokenizer.encode(text, add_special_tokens=prompt_cfg.template == "plain")

    return encode


def model_config(cfg: config_lib.RunConfig) -> ModelConfig:
    """The policy's ModelConfig, read without loading any weights."""
    if cfg.model.hf_dir:
        return config_json.from_hf(read_config(cfg.model.hf_dir), **_choices(cfg))
    return ModelConfig(**{**dict(cfg.model.init), **_choices(cfg)})


def _choices(cfg: config_lib.RunConfig) -> dict:
    """The ModelConfig fields the run's model section decides, whatever the weights."""
    return dict(
        param_dtype=cfg.model.param_dtype,
        compute_dtype=cfg.model.compute_dtype,
        remat=cfg.model.remat,
        remat_policy=cfg.model.remat_policy,
        lora=_lora(cfg),
    )


def _lora(cfg: config_lib.RunConfig):
    """model.lora, or the rank, alpha and targets of model.lora_init's PEFT adapter."""
    chosen = lora_config(dict(cfg.model.lora))
    if chosen is None and cfg.model.lora_init:
        return peft_io.peft_lora_config(cfg.model.lora_init)
    return chosen


def check_memory(cfg: config_lib.RunConfig, echo: Callable[[str], object]) -> None:
    """Prints the start-up memory estimate; a ConfigError (one line) if it cannot fit."""

    est = memory.estimate(cfg, model_config(cfg), shared_device=True)
    echo(str(est))
    memory.check_fits(est, host_memory.available_bytes())


def build_model(
    cfg: config_lib.RunConfig, tokenizer: AnyTokenizer, rng: jax.Array
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) from a Hugging Face directory or a fresh init."""
    if cfg.model.hf_dir:
        choices = _choices(cfg)
        _, graphdef, params = load_hf(
            cfg.model.hf_dir,
            param_dtype=choices.pop("param_dtype"),
            compute_dtype=choices.pop("compute_dtype"),
            remat=choices.pop("remat"),
            remat_policy=choices.pop("remat_policy"),
            config_overrides=choices,  # lora: adapters drawn from `rng` beside the weights
            rng=rng,
        )
        return graphdef, _start_adapters(cfg, graphdef, params)
    model_cfg = ModelConfig(**{**dict(cfg.model.init), **_choices(cfg)})
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and vocab > model_cfg.vocab_size:
        raise ConfigError(
            f"model.init.vocab_size={model_cfg.vocab_size} is smaller than the "
            f"tokenizer's {vocab} tokens; raise it"
        )
    graphdef, params = decoder.init(model_cfg, rng)
    return graphdef, _start_adapters(cfg, graphdef, params)


def _start_adapters(cfg: config_lib.RunConfig, graphdef, params):
    """params with their adapters replaced by model.lora_init's PEFT adapter, when set."""
    if not cfg.model.lora_init:
        return params
    adapters = peft_io.load_peft(cfg.model.lora_init, decoder.config_of(graphdef))
    dtype = jax.numpy.dtype(lora.ADAPTER_DTYPE)
    nnx.replace_by_pure_dict(
        params, {"layers": {k: jax.numpy.asarray(v, dtype) for k, v in adapters["layers"].items()}}
    )
    return params


@dataclasses.dataclass
class Components:
    """Everything a run is made of; tests may replace parts (e.g. a scripted trainer, a fake
    sampler: the run uses `sampler` through the Sampler protocol only)."""

    sampler: Sampler
    trainer: Trainer  # or anything with its train_step (distributed.trainer_group.Leader)
    state: TrainState
    # Problems to draw from: a PromptStream, a generator, ... (data.prompts.CheckpointableStream:
    # with get_state/set_state, a checkpoint keeps its position and a resume restores it)
    stream: Iterator[Problem]
    tokenizer: AnyTokenizer
    encode_prompt: PromptEncoder
    admission: Admission
    num_sampler_devices: int
    num_trainer_devices: int
    shared_devices: bool  # sampler and trainer run on the same devices
    graphdef: nnx.GraphDef  # the policy's model graphdef (checkpoints record its ModelConfig)
    # (params, version) -> a fresh Sampler like `sampler` (held-out evaluation runs on one);
    # None: no evaluation (eval_every must be 0)
    make_sampler: Callable[[nnx.State, int], Sampler] | None = None
    # trainer params -> arrays on this process's devices (a trainer spanning several
    # processes gathers them: distributed.trainer_group); identity for a one-process trainer
    local_params: Callable[[nnx.State], nnx.State] = lambda params: params
    # RunCheckpointer's signature: the run's checkpointer (a trainer spanning several
    # processes checkpoints with all of them)
    make_checkpointer: Callable[..., RunCheckpointer] = RunCheckpointer


def build(
    cfg: config_lib.RunConfig,
    devices: Sequence[jax.Device] | None = None,
    *,
    prompts: Iterable[Problem] | None = None,
    loss_fn: LossFn | None = None,
    optimizer: optax.GradientTransformation | None = None,
    sampler: Sampler | None = None,
    trainer_devices: Sequence[jax.Device] | None = None,
) -> Components:
    """Meshes, model, trainer state, sampler, data stream and admission. (The run builds
    the weight Publisher over `sampler.prepare`, so a replaced sampler gets its own.)

    prompts: the stream to draw from instead of the config's (any iterable of Problems);
    loss_fn, optimizer: passed to the Trainer when given (its defaults come from cfg);
    sampler: generate with this one instead of building a PagedSampler here (e.g. a
    distributed.RemoteSampler; held-out evaluation still runs on a local PagedSampler);
    trainer_devices: the trainer mesh's devices instead of a split of `devices` (a
    multi-process run, whose samplers are other processes: every device of the trainer
    processes, distributed.trainer_group.group_devices)."""
    devices = devices or jax.local_devices()
    if trainer_devices is None:
        sampler_devices, trainer_devices = split_devices(devices, cfg.devices)
    else:  # the samplers are elsewhere: held-out evaluation shares this process's devices
        sampler_devices, trainer_devices = list(devices), list(trainer_devices)
    cfg.sampler.check_shards(len(sampler_devices) // cfg.devices.sampler_tp)
    tokenizer, source, encode = build_data(cfg, load_source=prompts is None)
    env = cfg.env.make()
    if env is not None:  # episodes start from the environment's first messages
        codec = EpisodeCodec(tokenizer)
        encode = lambda problem: codec.prompt(env.first_messages(problem))
    if prompts is None:
        stream = PromptStream(source, seed=cfg.data.shuffle_seed + cfg.seed)
    else:
        stream = prompts_lib.as_stream(prompts)
    graphdef, params = build_model(cfg, tokenizer, jax.random.key(cfg.seed))

    mesh = trainer_mesh(trainer_devices, tp=cfg.devices.trainer_tp)
    # Only what the caller gave: a Trainer without these keywords keeps working.
    custom = {k: v for k, v in (("loss_fn", loss_fn), ("optimizer", optimizer)) if v is not None}
    trainer = Trainer(cfg.trainer, graphdef, jax.eval_shape(lambda: params), mesh, **custom)
    trainer.check_rows(cfg.batch.num_rows)
    state = trainer.init_state(params)

    eos = tuple(getattr(tokenizer, "eos_token_ids", ()))
    sampler_cfg = dataclasses.replace(cfg.sampler, seed=cfg.sampler.seed + cfg.seed)
    s_mesh = sampler_mesh(sampler_devices, cfg)

    detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)

    main: list[PagedSampler] = []  # the run's own PagedSampler, once built

    def make_sampler(params: nnx.State, version: int = 0) -> PagedSampler:
        # With LoRA the trainer's params are the adapters: a second sampler (evaluation) reads
        # the main sampler's converted base, or else gets the adapters joined to the trainer's.
        share = None
        if trainer.lora is not None and is_adapters_only(params):
            if main:
                share = main[0]
            else:
                params = trainer.full_params(params)
        # Same graphdef, engine config and mesh: every sampler shares the compiled functions.
        return PagedSampler(
            graphdef,
            params,
            sampler_cfg,
            version=version,
            eos_token_ids=eos,
            mesh=s_mesh,
            detokenize=detokenize,  # the text that stop strings (an environment's) match
            share_base=share,
        )

    if sampler is None:
        sampler = make_sampler(params)
        sampler.warm_up()  # with sampler.prefill_pad_tokens: every prefill shape, now
        main.append(sampler)
        if trainer.lora is not None:
            # One copy of the frozen base: the trainer reads the sampler's where both are one
            # device (Trainer.read_base checks that, and the dtypes).
            try:
                trainer.read_base(sampler.base_for_trainer())
            except ConfigError as err:
                logging.info("LoRA base: the trainer keeps its own copy (%s)", err)
    params = None  # with a shared base, the trainer's own copy goes with it

    admission = Admission(
        groups_per_step=cfg.groups_per_step,
        max_lag=cfg.max_lag,
        mode=cfg.mode,
        round_steps=cfg.conventional_steps,
    )
    return Components(
        sampler=sampler,
        trainer=trainer,
        state=state,
        stream=stream,
        tokenizer=tokenizer,
        encode_prompt=encode,
        admission=admission,
        num_sampler_devices=len(sampler_devices),
        num_trainer_devices=len(trainer_devices),
        shared_devices=not set(sampler_devices).isdisjoint(trainer_devices),
        graphdef=graphdef,
        make_sampler=make_sampler,
    )


def build_evaluator(
    cfg: config_lib.RunConfig, c: Components, reward_pool: RewardPool, env_pool=None
) -> Evaluator | None:
    """evaluate(params, version) -> metrics on held-out problems, or None when disabled.

    It runs on its own sampler (`c.make_sampler`: same engine config, so the compiled chunk is
    shared) with the trainer's latest params, in the trainer thread between two steps: eval
    samples are never trained and never touch the main sampler, so the lag accounting is
    unaffected. That sampler is built for each evaluation and dropped after it, so its param
    copy and KV pool (~0.8 GB for SmolLM2-135M in f32) are not held between evaluations.
    With an environment (cfg.env), held-out problems are played as episodes on `env_pool`."""
    if not cfg.eval_every:
        return None
    if c.make_sampler is None:
        raise ConfigError(
            f"config.eval_every={cfg.eval_every} needs Components.make_sampler (a sampler for "
            "held-out problems); set eval_every=0 or give one"
        )

    if cfg.eval.datasets:
        problems = load_problems(cfg.eval.datasets, "eval.datasets")
        prompt_cfg = prompt_config(cfg.data)
    else:
        problems = held_out_problems(
            cfg.data.task, dict(cfg.data.task_options), cfg.eval.num_problems
        )
        text = make_task(cfg.data.task, **dict(cfg.data.task_options)).text_task
        prompt_cfg = (
            prompt_config(cfg.data) if text else PromptConfig(template="plain", system_prompt=None)
        )
    problems = problems[: cfg.eval.num_problems]
    sampling = SamplingParams(
        temperature=0.0 if cfg.eval.greedy else cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
    )

    def evaluate(params: nnx.State, version: int) -> dict:
        sampler = c.make_sampler(c.local_params(params), version)
        if cfg.env.name:
            driver = make_driver(cfg.env, c.tokenizer, env_pool, max_new_tokens=cfg.max_new_tokens)
            return evaluate_episodes(sampler, driver, problems, cfg.eval.k, sampling)
        return evaluate_problems(
            sampler,
            c.tokenizer,
            problems,
            reward_pool,
            cfg.eval.k,
            sampling,
            prompt_cfg,
        )

    return evaluate
