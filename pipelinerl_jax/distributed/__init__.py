"""Several processes under jax.distributed: roles, supervision, weights.

- runtime.py     a process's place in the run (coordinator, process id, role) and a bounded
                 `jax.distributed.initialize`
- supervisor.py  starts local processes, streams their output, and ends them all when one fails
- weights.py     the trainer publishes each weight version once; samplers pull the newest
"""
