"""Small model configs and the transformers reference decode the tests share.

torch is imported by the two functions that use it, so the configs import without it (the
jax 0.11 suite runs without torch: tests/conftest.py).
"""

from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.tiny_model import tiny_config


def model_config(**overrides) -> ModelConfig:
    """models.tiny_config's 2-layer GQA Llama (hidden 32, 4 query / 2 kv heads of 8), with the
    eps and position limit these tests were written against; fields overridable."""
    fields = {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64,
        "attention_bias": False,  # not the family's own switches: the tests set them
        "qk_norm": False,
        **overrides,
    }
    return tiny_config(fields.pop("model_type", "llama"), **fields)


def hf_greedy(model, prompt, max_new_tokens: int, eos=None):
    """transformers' greedy `generate`: (new tokens, their logprobs, smallest top-2 logit gap)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack(out.logits)[:, 0].float()
    logprobs = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens].numpy()
    top2 = torch.topk(logits, 2).values
    return tokens, logprobs, float((top2[:, 0] - top2[:, 1]).min())


LLAMA3_ROPE = (
    ("factor", 4.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8),
    ("rope_type", "llama3"),
)


def every_option(**overrides) -> ModelConfig:
    """`model_config` with every optional piece on: q/k/v bias, qk-norm, llama3 RoPE scaling."""
    options = dict(
        model_type="qwen3",
        rms_norm_eps=1e-6,
        rope_scaling=LLAMA3_ROPE,
        attention_bias=True,
        qk_norm=True,
    )
    return model_config(**{**options, **overrides})


def save_hf_llama(path, seed: int, vocab_size: int):
    """Saves a random 2-layer GQA transformers Llama (untied, weights std 0.15, so greedy
    decoding has clear margins) to `path`; returns the torch model in eval mode."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.15,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model
