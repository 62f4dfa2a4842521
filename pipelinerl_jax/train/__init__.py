"""The train step on its own mesh, and the run's checkpoints.

- trainer.py        TrainerConfig, the Trainer (jitted train step, FSDP x TP mesh; with LoRA
                    the adapters trained, the base frozen beside the state)
- optimizer.py      the default optimizer: AdamW, its learning-rate schedule and decay mask
- checkpoint.py     Orbax checkpoints of the train state: RunCheckpointer, corrupt steps
- pytree_dicts.py   pytrees as path-keyed nested dicts, leaf manifests, abstract restore targets
- json_items.py     a checkpoint's JSON items: the extra dict made JSON-safe, the ModelConfig
- resume_compat.py  which config changes a resumed run allows, which it refuses
"""
