"""models package of pipelinerl_jax."""
