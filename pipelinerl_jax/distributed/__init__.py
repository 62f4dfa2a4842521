"""Several processes under jax.distributed: roles, supervision, weights.

- runtime.py     a process's place in the run (coordinator, process id, role) and a bounded
                 `jax.distributed.initialize`
- supervisor.py  starts local processes, streams their output, and ends them all when one fails
- failures.py    without a supervisor: a process's exception or death ends the others, named
                 in one line
- channel.py     ordered message queues over the jax.distributed key-value store
- remote_sampler.py  the Sampler protocol over sampler processes, and the loop they run
- roles.py       what the trainer and sampler processes run; --spawn_local
- trainer_group.py  one trainer over several processes: process 0 leads, the others replay
                 its train steps, gathers and checkpoints
- weights.py     weight publication: the protocol, its keys and shared helpers; the trainer's
                 end is weight_server.py (WeightServer), a sampler's weight_client.py
"""
