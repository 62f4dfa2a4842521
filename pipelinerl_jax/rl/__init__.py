"""rl package of pipelinerl_jax."""
