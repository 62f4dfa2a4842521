"""The train step on its own mesh, and the run's checkpoints.

- trainer.py     TrainerConfig, the Trainer (jitted train step, optimizer, FSDP x TP mesh)
- checkpoint.py  Orbax checkpoints of the train state, resumable and config-checked
"""
