"""pipelinerl_jax: asynchronous on-policy RL for LLMs in JAX (PipelineRL).

Generation and training run at the same time on separate device meshes; new weights enter
the sampler between decode chunks without discarding the KV cache, and every token records
the policy version that produced it.

Layers. Each imports only from the layers above it (tests/test_layers.py checks it), so a
researcher can lift a layer and what is above it, and the application stays on top:

  0 foundation  errors, cli (one-line errors, exit code 2), interrupts (Ctrl-C never
                lost), glibc_malloc (fewer arenas, free pages handed back between steps),
                sharding, kernels (paged attention: the Triton kernel and its jnp
                reference), models (families, the decoder, Hugging Face and GGUF
                checkpoints)
  1 parts       rewards, data (prompt streams, tasks), envs (multi-turn environments and
                tools), rl (batches, advantages, objectives, losses), sampler (paged KV
                cache, continuous batching, decode chunks)
  2 train       train (TrainerConfig, the Trainer and its jitted step, checkpoints)
  3 run         pipeline (the run config, coordinator, admission and lag, weight
                publication, metrics, pipeline.run), distributed (several processes)
  4 app         config_cli, config_schema, presets, evaluate, evaluate_settings, generate,
                export, dry_run, plan
                (the paper's throughput model and GPU predictions); launch.py sits on top

Within layer 1, rewards comes before data, data before envs, and rl before sampler.

Dimension letters, one meaning across the project. Arrays carry their shape in their names
(`logits_BxTxV`), and each model, sampler and kernel file lists the letters it uses:

  B  batch: sequences (in a forward, a step's samples, the sampler's slots)
  T  tokens per row (query positions);  Q  a block of query positions (a slice of T)
  S  key positions: the keys attended to, or the positions one KV page holds (page size)
  N  a flat count of tokens (B * T, W * S, or any token axes flattened)
  R  rows: of a packed training batch, or of a prefill call
  U  groups (a prompt's attempts)
  L  layers        V  vocabulary      E  hidden (embedding)      F  MLP hidden
  H  query heads   K  kv heads        G  query heads per kv head (H / K)      D  head dim
  O  output features of a matmul      I  its input features
  P  pages in the KV pool             M  pages per slot (block-table width)
  W  pages a decode step reads (window)                 X  stop tokens per slot
  C  chunks: steps of a decode chunk, or pieces a long axis is cut into (Vc, Nc: their sizes)
  A  micro-batches (gradient accumulation steps)
  J  LoRA rank (the adapters' inner dimension, models/lora.py)

An `x` with no letter on one side stands for any leading or trailing axes: `hidden_xE` is
[..., E], `x_Cx` is [C, ...]. A name with no letters is a scalar or says its shape beside it.

plan/ keeps the paper's own notation for its throughput model (listed in plan/model.py).
"""

__version__ = "0.1.0"
