"""plan package of pipelinerl_jax."""
