"""The embedded default: a tiny decoder learns to reverse digit strings on CPU, in pipeline mode.

    python launch.py --config=configs/default.py --workdir=/tmp/prl_default
    make run                                   # the same, with a fresh workdir under runs/

A 2-layer, d=128 Llama-style decoder (~0.4M params) starts from random weights and is trained
with truncated-IS REINFORCE on "reverse 1-5 digits" (partial-credit reward, random policy
~0.03). Generation and training run in two threads; after every optimizer step the new
weights are swapped into the sampler between two decode chunks, so most sequences mix tokens
of two policy versions, and the log shows the lag histogram.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "pipeline"            # "pipeline" (in-flight updates) | "conventional"
    c.max_lag = 2                  # pipeline: tokens are at most this many steps stale
    c.conventional_steps = 4       # conventional: steps per frozen-weight generation round
    c.steps = 800                  # optimizer steps (about 3-5 minutes on 2 idle cores)
    c.group_size = 8               # attempts per prompt
    c.batch_size = 64              # sequences per optimizer step
    c.log_every = 20
    c.checkpoint_every = 100       # optimizer steps between checkpoints (0: never); needs --workdir
    c.checkpoint_keep = 3

    c.model = ml_collections.ConfigDict()
    c.model.hf_dir = ""            # a Hugging Face directory to start from instead of init
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"
    c.model.init = dict(
        model_type="llama", vocab_size=16, hidden_size=128, intermediate_size=384,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=True, attention_bias=False, qk_norm=False)

    c.data = ml_collections.ConfigDict()
    c.data.task = "reverse_digits"
    c.data.task_options = dict(min_digits=1, max_digits=5)
    c.data.datasets = []
    c.data.prompt_template = "plain"
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
    c.sampler.kv_policy = "keep"   # "keep" (the paper) | "recompute"

    c.reward = ml_collections.ConfigDict()
    c.reward.fn = "task"
    c.reward.table = "pure_success"
    c.reward.workers = 0           # the task reward is cheap: score in the sampler thread

    c.trainer = ml_collections.ConfigDict()
    c.trainer.learning_rate = 1e-3
    c.trainer.lr_schedule = "constant"
    c.trainer.warmup_steps = 10
    c.trainer.weight_decay = 0.0
    c.trainer.grad_clip_norm = 1.0
    c.trainer.micro_batches = 1

    c.loss = ml_collections.ConfigDict()
    c.loss.objective = "tis_reinforce"
    c.loss.entropy_coef = 0.03     # keeps exploring: without it the policy collapsed early
    c.loss.entropy_coef_end = ml_collections.config_dict.placeholder(float)  # None: constant
    c.loss.entropy_schedule_steps = 0

    c.batch = ml_collections.ConfigDict()
    c.batch.advantage = "group_mean"
    c.batch.filter_zero_std_groups = False
    c.batch.weighting = "sequence_sum"
    c.batch.normalize_std = True   # per-group std: comparable step sizes across groups

    c.eval_every = 100             # held-out evaluation every N steps and at the end (0: never)
    c.eval = ml_collections.ConfigDict()
    c.eval.num_problems = 64       # held-out problems (a task seed the run never draws from)
    c.eval.k = 1
    c.eval.greedy = True
    c.eval.datasets = []           # held-out files when training on data.datasets

    c.devices = ml_collections.ConfigDict()
    c.devices.sampler = 0.5
    c.devices.trainer_tp = 1
    return c
