"""rewards package of pipelinerl_jax."""
