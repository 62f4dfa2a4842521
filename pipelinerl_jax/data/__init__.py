"""data package of pipelinerl_jax."""
