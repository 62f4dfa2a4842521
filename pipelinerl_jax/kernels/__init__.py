"""kernels package of pipelinerl_jax."""
