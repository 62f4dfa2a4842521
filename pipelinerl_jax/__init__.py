"""pipelinerl_jax: asynchronous on-policy RL for LLMs in JAX (PipelineRL).

Generation and training run at the same time on separate device meshes; new weights enter
the sampler between decode chunks without discarding the KV cache, and every token records
the policy version that produced it.
"""

__version__ = "0.1.0"
