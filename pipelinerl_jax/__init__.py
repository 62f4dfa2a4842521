"""pipelinerl_jax: asynchronous on-policy RL for LLMs in JAX (PipelineRL).

Generation and training run at the same time on separate device meshes; new weights enter
the sampler between decode chunks without discarding the KV cache, and every token records
the policy version that produced it.

Packages: models (families, the decoder, checkpoints), kernels (paged attention), sampler
(paged KV cache, continuous batching, decode), rl (batches, advantages, objectives), pipeline
(the coordinator and `pipeline.run`), data and rewards (prompt streams, tasks, verifiers),
plan (the paper's throughput model); trainer.py, sharding.py, checkpoint.py and the CLIs.

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

plan/ keeps the paper's own notation for its throughput model (listed in plan/model.py).
"""

__version__ = "0.1.0"
