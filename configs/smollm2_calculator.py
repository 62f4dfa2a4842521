"""SmolLM2-135M-Instruct learns word problems with a calculator, over several turns.

    make real-model   # once: models/SmolLM2-135M-Instruct
    python launch.py --config=configs/smollm2_calculator.py --workdir=runs/calculator

The model's turn ends at each "=" it writes; the "equations" environment appends the value of
the arithmetic before it inside the model's message (evaluated safely, no `eval`), and
decoding goes on from the kept KV cache. The final `\\boxed{}` answer is scored by math-verify.
"""

from pipelinerl_jax import presets


def get_config():
    # The values, and why, live in the installed package: presets.smollm2_calculator().
    return presets.smollm2_calculator_config()
