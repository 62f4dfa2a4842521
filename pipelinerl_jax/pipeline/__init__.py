"""pipeline package of pipelinerl_jax."""
