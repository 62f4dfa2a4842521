"""Ready-made run configs, importable from the installed package (configs/*.py delegate here).

    from pipelinerl_jax import pipeline, presets
    cfg = presets.tiny(steps=2, trainer=dict(learning_rate=3e-3))   # a validated RunConfig
    summary = pipeline.run(cfg, "/tmp/run")

Each preset comes two ways: `demo()`, `tiny()`, `smollm2_math()` return a validated
`config.RunConfig` with keyword overrides applied (`run_config`), and `demo_config()`,
`tiny_config()`, `smollm2_math_config()` return the ml_collections.ConfigDict that
`launch.py --config=configs/<name>.py` starts from (`default.py` is the demo). `PRESETS` maps
the names to the ConfigDict builders.

Overrides, like launch.py's `--config.<field>=<value>` but with Python values: a top-level
field (`steps=2`), a section as a dict of some of its fields (`trainer=dict(learning_rate=
3e-3)`: the others keep the preset's values; a dict field inside it, such as
`data=dict(task_options={...})`, is replaced whole), or any dotted path, keys of model.init,
data.task_options and reward.table_options included (`**{"model.init.num_layers": 3}`). The
result is validated as a config file's would be: a bad name or value is a one-line ConfigError.
"""

import copy
from collections.abc import Callable, Mapping

import ml_collections

from pipelinerl_jax import config_cli
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import config_dict


def demo_config() -> ml_collections.ConfigDict:
    """The embedded default (configs/default.py, `make run`): a 2-layer d=128 decoder learns to
    reverse 2-5 digits from random weights in pipeline mode, 1000 steps (~2 min on 2 idle
    cores). Why each value is what it is: configs/default.py's docstring and the comments."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "pipeline"  # "pipeline" (in-flight updates) | "conventional"
    c.max_lag = 2  # pipeline: tokens are at most this many steps stale
    c.conventional_steps = 4  # conventional: steps per frozen-weight generation round
    c.steps = 1000  # optimizer steps: ~2 min on 2 idle cores, ~6 min on a busy one
    c.group_size = 8  # attempts per prompt
    c.batch_size = 64  # sequences per optimizer step
    c.log_every = 20
    c.checkpoint_every = 100  # optimizer steps between checkpoints (0: never); needs --workdir
    c.checkpoint_keep = 3
    c.compile_cache = "auto"  # persistent XLA cache in ~/.cache/pipelinerl_jax ("": off)
    c.trim_host_memory = True  # free heap pages back to the kernel before each train step
    # Pipeline mode that replays bit for bit from the seed, kill -9 and resume included:
    # swaps land at chunk boundaries fixed by step counts (docs/async_rl.md, what it costs).
    c.deterministic = False
    c.swap_chunks = 0  # deterministic: decode chunks between swaps (0: derived)

    c.model = ml_collections.ConfigDict()
    c.model.hf_dir = ""  # a Hugging Face directory to start from instead of init
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"
    # LoRA: rank > 0 trains adapters on a frozen base instead (docs/lora.md); 0: full fine-tuning
    c.model.lora = dict(rank=0, alpha=32.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    c.model.init = dict(
        model_type="llama",
        vocab_size=16,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=False,
    )

    c.data = ml_collections.ConfigDict()
    c.data.task = "reverse_digits"
    c.data.task_options = dict(min_digits=2, max_digits=5)  # 1-digit answers make a trap
    c.data.datasets = []
    c.data.prompt_template = "plain"
    c.data.system_prompt = ml_collections.config_dict.placeholder(str)  # None: the paper's
    c.data.few_shot = []  # [dict(question=..., answer=...)]: shown before each question
    c.data.shuffle_seed = 0

    c.generation = ml_collections.ConfigDict()
    c.generation.max_prompt_tokens = 8
    c.generation.max_new_tokens = 8
    c.generation.temperature = 1.0
    c.generation.top_p = 1.0
    c.generation.top_k = 0

    c.sampler = ml_collections.ConfigDict()
    c.sampler.num_slots = 64
    c.sampler.max_seq_len = 16
    c.sampler.page_size = 16
    c.sampler.chunk_steps = 4
    c.sampler.prefill_chunk = 16
    c.sampler.max_prefill_rows = 16
    c.sampler.kv_policy = "keep"  # "keep" (the paper) | "recompute"
    # Decode's weights and activations ("bfloat16" under an f32 trainer: half the bytes a
    # decode step reads; docs/real_model.md#a-bf16-sampler). None: the model's compute dtype.
    c.sampler.compute_dtype = ml_collections.config_dict.placeholder(str)
    c.sampler.attention = "auto"  # "auto": Triton paged kernel on GPU, "staged" on CPU |
    # "paged" | "staged" | "gather" (docs/gpu.md#decode-attention-strategies)
    # Batch widths decode may run at: n > 1 packs running sequences low and decodes the
    # narrowest of slots, slots/2, ... slots/2^(n-1) that holds them (n compiles per window).
    c.sampler.decode_widths = 1

    c.reward = ml_collections.ConfigDict()
    c.reward.fn = "task"
    c.reward.table = "pure_success"
    c.reward.table_options = {}  # coefficient overrides, e.g. {"format_weight": 0.3}
    c.reward.workers = 0  # the task reward is cheap: score in the sampler thread

    c.trainer = ml_collections.ConfigDict()
    c.trainer.learning_rate = 1e-3  # 2e-3: the policy fell back to near-uniform mid-run
    c.trainer.lr_schedule = "constant"
    c.trainer.warmup_steps = 10
    c.trainer.weight_decay = 0.0
    c.trainer.grad_clip_norm = 1.0
    c.trainer.micro_batches = 1

    c.loss = ml_collections.ConfigDict()
    # PPO's clip (the reference offers it beside truncated IS): nearly every token here is two
    # versions stale, and with "tis_reinforce" about one seed-run in ten stalled near 0.35;
    # over 10 seeds each, PPO gained more on average and in the worst seed (docstring).
    c.loss.objective = "ppo"
    c.loss.entropy_coef = 0.03  # keeps exploring: without it the policy collapsed early
    c.loss.entropy_coef_end = ml_collections.config_dict.placeholder(float)  # None: constant
    c.loss.entropy_schedule_steps = 0

    c.batch = ml_collections.ConfigDict()
    c.batch.advantage = "group_mean"
    c.batch.filter_zero_std_groups = False  # True shrinks the batch (and the entropy bonus)
    # Dynamic sampling: drop groups whose raw scores are all alike and refill the step.
    c.batch.filter_groups = False
    c.batch.filter_min_std = 0.0
    c.batch.filter_refill_limit = 4.0  # refills per step, in multiples of groups_per_step
    c.batch.weighting = "sequence_sum"
    c.batch.normalize_std = False  # True learned slower and plateaued lower here

    c.eval_every = 100  # held-out evaluation every N steps and at the end (0: never)
    c.eval = ml_collections.ConfigDict()
    c.eval.num_problems = 64  # held-out problems (a task seed the run never draws from)
    c.eval.k = 1
    c.eval.greedy = True
    c.eval.datasets = []  # held-out files when training on data.datasets
    c.eval.at_start = False  # also evaluate the starting policy (step 0)

    c.env = ml_collections.ConfigDict()
    c.env.name = ""  # "": one answer per prompt; "guess", "calculator", "module:callable"
    c.env.options = {}  # the environment's keyword arguments
    c.env.max_turns = 0  # 0: the environment's own
    c.env.turn_tokens = 0  # tokens per model turn (0: the episode's budget bounds it)
    c.env.workers = 2  # processes answering turns, each with timeout_s per turn
    c.env.timeout_s = 5.0

    c.devices = ml_collections.ConfigDict()
    c.devices.sampler = 0.5
    c.devices.trainer_tp = 1
    c.devices.sampler_tp = 1  # tensor-parallel degree of the sampler mesh
    return c


def tiny_config() -> ml_collections.ConfigDict:
    """A seconds-scale smoke run (configs/tiny.py): the demo's task on a 2-layer d=32 decoder,
    8 steps of 16 sequences. It does not learn much; it checks an installation end to end."""
    c = demo_config()
    c.steps = 8
    c.group_size = 4
    c.batch_size = 16
    c.log_every = 1
    c.batch.filter_zero_std_groups = False
    c.generation.max_new_tokens = 12
    c.sampler.num_slots = 16
    c.sampler.max_seq_len = 24
    c.sampler.chunk_steps = 2
    c.model.init.update(
        hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16
    )
    return c


def guess_config() -> ml_collections.ConfigDict:
    """The multi-turn toy (configs/guess.py): the demo's decoder, from random weights, learns
    to find a secret number in [0, 15] within 6 turns from the "guess" environment's "<" /
    ">" answers. Every prompt is the same, so only the feedback can tell it the number. A
    guess is one base-16 character, so a turn is one token and an answer another."""
    c = demo_config()
    c.steps = 2500  # ~6 min on 2 idle cores
    c.log_every = 100
    c.eval_every = 500
    c.eval.at_start = True  # the random policy's success opens the curve
    c.loss.objective = "tis_reinforce"  # what its measurements (bench/demo_seeds.py) used
    c.loss.entropy_coef = 0.01  # 0.03 (the demo's) kept the policy near uniform here
    # Cosine to 0: at a constant 1e-3 a seed that reached 0.8 held-out success at step
    # 1500 fell back to 0.16 by step 2000 (entropy 0.5 -> 1.3).
    c.trainer.lr_schedule = "cosine"
    c.model.init.update(vocab_size=24)  # the guess task's characters: 0-9, a-f, "+=:<>"
    c.data.task = "guess_number"
    c.data.task_options = dict(lo=0, hi=15)
    c.env.name = "guess"
    # The task's characters; a guess is one hex digit. `consistency` pays 0.1 for each guess
    # the answers so far leave possible: with the success reward alone the policy was still
    # near uniform after 1000 steps, with it it uses the answers within a few hundred.
    c.env.options = dict(higher=">", lower="<", again="=", base=16, consistency=0.1)
    c.env.max_turns = 6
    c.env.turn_tokens = 1  # a guess: one character
    c.env.workers = 0  # a comparison: answered in the sampler thread, no process hop
    c.generation.max_prompt_tokens = 6  # <bos>0:15=
    c.generation.max_new_tokens = 11  # 6 guesses, 5 answers between them
    c.sampler.max_seq_len = 17
    return c


def smollm2_math_config() -> ml_collections.ConfigDict:
    """SmolLM2-135M-Instruct learns GSM8K-format word problems on 2 CPU cores
    (configs/smollm2_math.py; `make real-model` puts the model in models/ first, and
    model.hf_dir is relative to the working directory)."""
    c = demo_config()
    c.steps = 48  # ~20 min on 2 cores (bench/real_learning.py runs the same)
    c.max_lag = 1
    c.group_size = 4
    c.batch_size = 16
    c.log_every = 1
    c.checkpoint_every = 10
    c.eval_every = 24

    c.model.hf_dir = "models/SmolLM2-135M-Instruct"
    c.model.init = {}
    c.model.remat = True  # far less train-step memory, and no slower here
    # Keeping every matmul output the backward reads costs little memory in one-row
    # micro-batches, and no projection runs twice (docs/cpu_measurements.md#remat-policy).
    c.model.remat_policy = "matmuls"

    c.data.task = "word_problems"
    c.data.task_options = dict(difficulty=1)
    c.data.prompt_template = "chat"
    # The model follows a shown answer format far more often than a described one: with the
    # paper's system prompt alone almost no sampled answer is boxed (it ends with "#### N" or
    # "The answer is N"), so no group's attempts differ in reward and nothing is learned. One
    # worked example as an earlier chat turn fixes that (bench/real_prompts.py measures it).
    c.data.system_prompt = None  # the paper's
    c.data.few_shot = [
        dict(
            question="Mia has 3 apples and buys 4 more. How many apples does Mia have now?",
            answer=(
                "Mia starts with 3 apples and buys 4 more, so she has 3 + 4 = 7 apples.\n"
                "The answer is \\boxed{7}."
            ),
        )
    ]

    c.generation.max_prompt_tokens = 144  # the longest one-shot prompt is 131 tokens
    c.generation.max_new_tokens = 144  # median answer 53 tokens, 90th percentile ~150
    # At T=1 a 135M model's answers drift off topic (bench/real_prompts.py); T=0.8 keeps them
    # coherent, and the trainer's importance ratios use the same temperature.
    c.generation.temperature = 0.8

    c.sampler.num_slots = 16
    c.sampler.max_seq_len = 288
    c.sampler.page_size = 16
    c.sampler.chunk_steps = 16
    c.sampler.prefill_chunk = 144  # every prompt in one chunk
    c.sampler.max_prefill_rows = 4  # a step admits at most 16 slots / 4 attempts prompts
    c.sampler.prefill_pad_tokens = True  # 3 prefill shapes (1, 2, 4 rows), compiled at start
    c.sampler.min_window_pages = 18  # = max_seq_len / page_size: one window
    # A step's 16 attempts start together and end unevenly (about half the slot-steps idle):
    # decode 16, 8 or 4 slots, whichever holds the running ones (3 compiles, at warm-up).
    c.sampler.decode_widths = 3

    c.reward.fn = "math"
    c.reward.table = "success_and_format"
    c.reward.table_options = dict(format_weight=0.3)  # a boxed answer pays before a right one
    c.reward.workers = 2

    # The 4 attempts of a prompt share one copy of it in the train step (same gradients; the
    # one-shot prompt is ~130 tokens, a typical answer ~55), in rows sized for a typical group.
    # One row per micro-batch, so the rows a step leaves empty are skipped, not computed: a
    # step trains ~4 rows of 448 tokens where one sequence per row trained 16 x 288.
    c.batch.share_prompts = True
    c.batch.seq_len = 448
    c.batch.num_rows = 16  # the worst case: every attempt alone in its row
    c.trainer.micro_batches = 16

    c.trainer.learning_rate = 1e-5
    c.trainer.lr_schedule = "constant"
    c.trainer.warmup_steps = 2
    c.trainer.weight_decay = 0.0
    c.trainer.grad_clip_norm = 1.0

    c.loss.objective = "tis_reinforce"
    c.loss.entropy_coef = 0.0

    c.batch.advantage = "group_mean"
    c.batch.weighting = "sequence_sum"

    c.eval.num_problems = 40
    c.eval.greedy = True
    c.eval.at_start = True  # the starting model's score opens the curve
    return c


def smollm2_calculator_config() -> ml_collections.ConfigDict:
    """SmolLM2-135M-Instruct solves word problems with a calculator over several turns
    (configs/smollm2_calculator.py). The "equations" environment completes the model's own
    equations: its turn ends at "=", the calculator appends the value of the arithmetic
    before it inside the model's message, and the model goes on to a `\\boxed{}` answer.
    (The `<calc>` tag syntax of the "calculator" environment is never written by a model
    this small, however it is shown: envs/equations.py.)"""
    c = smollm2_math_config()
    c.steps = 30  # ~30 min on 2 cores: an episode's turns each wait for a chunk boundary
    c.eval_every = 15
    c.data.few_shot = []  # the environment's first messages carry the worked example
    c.data.system_prompt = ""
    c.env.name = "equations"
    c.env.max_turns = 8  # an answer has 1-3 equations; 8 leaves room for rewriting them
    c.env.workers = 2
    c.generation.max_prompt_tokens = 176  # the longest prompt (system + example) is ~160
    c.generation.max_new_tokens = 160  # the whole episode: turns and the calculator's values
    c.sampler.max_seq_len = 336
    c.sampler.prefill_chunk = 176
    c.sampler.min_window_pages = 21  # = max_seq_len / page_size: one window
    c.batch.seq_len = 512
    return c


def run_config(c: ml_collections.ConfigDict, **overrides) -> config_lib.RunConfig:
    """`c` (left unchanged) with `overrides` applied (see the module docstring), validated."""
    c = copy.deepcopy(c)  # the caller's ConfigDict stays as it was
    with c.unlocked():
        for path, value in _paths(overrides):
            config_cli.set_path(c, path, value)
    return config_dict.from_config_dict(c)


def _paths(overrides: Mapping) -> list[tuple[str, object]]:
    """(dotted path, value) pairs: a section's dict is spread over its fields."""
    out = []
    for key, value in overrides.items():
        if key in config_dict.SECTIONS and isinstance(value, Mapping):
            out.extend((f"{key}.{field}", v) for field, v in value.items())
        else:
            out.append((key, value))
    return out


def demo(**overrides) -> config_lib.RunConfig:
    """The embedded default as a RunConfig (demo_config), with `overrides` applied."""
    return run_config(demo_config(), **overrides)


def tiny(**overrides) -> config_lib.RunConfig:
    """The smoke-test config as a RunConfig (tiny_config), with `overrides` applied."""
    return run_config(tiny_config(), **overrides)


def guess(**overrides) -> config_lib.RunConfig:
    """The multi-turn toy as a RunConfig (guess_config), with `overrides` applied."""
    return run_config(guess_config(), **overrides)


def smollm2_math(**overrides) -> config_lib.RunConfig:
    """The real-model config as a RunConfig (smollm2_math_config), with `overrides` applied."""
    return run_config(smollm2_math_config(), **overrides)


def smollm2_calculator(**overrides) -> config_lib.RunConfig:
    """The calculator-tool config as a RunConfig (smollm2_calculator_config)."""
    return run_config(smollm2_calculator_config(), **overrides)


PRESETS: dict[str, Callable[[], ml_collections.ConfigDict]] = {
    "demo": demo_config,
    "tiny": tiny_config,
    "guess": guess_config,
    "smollm2_math": smollm2_math_config,
    "smollm2_calculator": smollm2_calculator_config,
}
