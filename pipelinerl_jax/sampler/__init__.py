"""sampler package of pipelinerl_jax."""
