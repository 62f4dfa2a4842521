"""The train step sharded FSDP 4 x TP 2 over 8 simulated CPU devices equals the 1-device step.

So does the step on a ("data", "model") mesh with custom logical-axis rules (Trainer(rules=)),
whose params then carry the layout those rules give. Runs in a subprocess: the device count
must be fixed (XLA_FLAGS) before JAX initialises.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.xla_env import child_env

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import jax
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    from pipelinerl_jax import sharding
    from pipelinerl_jax.train import trainer as tr
    from pipelinerl_jax.models import decoder
    from pipelinerl_jax.rl.config import BatchConfig, LossConfig
    from pipelinerl_jax.rl.batch import build_batch
    from tests.test_trainer import samples, tiny_model

    assert jax.device_count() == 8
    cfg = tiny_model()
    graphdef, params = decoder.init(cfg, jax.random.key(5))
    abstract = decoder.abstract_init(cfg)[1]
    data = samples([(3, 6), (4, 5), (2, 7), (3, 4), (5, 3), (2, 2), (4, 6), (3, 3)], seed=6)
    batch, _ = build_batch(data, BatchConfig(seq_len=16, num_rows=8, max_sequences=8,
                                             max_sequence_len=12))
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01, token_chunk=16)
    results = []
    for devices, tp, micro in ((jax.devices()[:1], 1, 1), (jax.devices(), 2, 2)):
      tcfg = tr.TrainerConfig(learning_rate=1e-2, warmup_steps=0, lr_schedule="constant",
                              micro_batches=micro, loss=loss)
      trainer = tr.Trainer(tcfg, graphdef, abstract, tr.trainer_mesh(devices, tp=tp))
      state = trainer.init_state(params)
      for _ in range(2):
        state, metrics = trainer.train_step(state, batch)
      results.append((jax.device_get(state.params), jax.device_get(metrics), trainer, state))

    # Custom rules on a mesh with other axis names: hidden over "model", heads / MLP / vocabulary
    # over "data", batch rows over "data" (the transpose of the default layout).
    rules = (("embed", "model"), ("vocab", "data"), ("q_heads", "data"), ("kv_heads", "data"),
             ("mlp", "data"), ("batch", "data"))
    mesh = sharding.make_mesh((4, 2), ("data", "model"), jax.devices())
    tcfg = tr.TrainerConfig(learning_rate=1e-2, warmup_steps=0, lr_schedule="constant",
                            micro_batches=2, loss=loss)
    custom = tr.Trainer(tcfg, graphdef, abstract, mesh, rules=rules)
    assert custom.batch_shardings().tokens.spec == P("data")
    state = custom.init_state(params)
    for _ in range(2):
      state, metrics = custom.train_step(state, batch)
    pc, mc = jax.device_get(state.params), jax.device_get(metrics)
    custom_specs = {jax.tree_util.keystr(k): v.sharding.spec
                    for k, v in jax.tree_util.tree_leaves_with_path(state.params)}
    assert custom_specs["['layers']['q_proj'].value"] == P(None, "model", "data"), custom_specs
    assert custom_specs["['lm_head'].value"] == P("model", "data"), custom_specs
    # Adam's moments are laid out like their params.
    mu = optax.tree_utils.tree_get(state.opt_state, "mu")
    mu_specs = {jax.tree_util.keystr(k): v.sharding.spec
                for k, v in jax.tree_util.tree_leaves_with_path(mu)}
    assert mu_specs == custom_specs, (mu_specs, custom_specs)

    (p1, m1, _, _), (p8, m8, trainer, state) = results
    specs = {jax.tree_util.keystr(k): v.sharding.spec
             for k, v in jax.tree_util.tree_leaves_with_path(state.params)}
    assert specs["['layers']['q_proj'].value"] == P(None, "fsdp", "tp"), specs
    assert specs["['lm_head'].value"] == P("fsdp", "tp"), specs
    assert len(state.params["lm_head"].value.addressable_shards) == 8
    mu = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 4][0]
    assert mu.sharding.spec == P(None, "fsdp", "tp"), mu.sharding
    # Adam normalises each update to ~lr = 1e-2, so reduction-order noise in tiny gradients
    # can move a weight by ~1e-6: 1e-5 is 0.1% of one update.
    for other, metrics in ((p8, m8), (pc, mc)):
      for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(other)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
      for key in m1:
        np.testing.assert_allclose(m1[key], metrics[key], rtol=2e-5, atol=1e-6, err_msg=key)
    assert int(m8["version"]) == 1 and np.isfinite(m8["loss"]) and m8["kl_ref"] > 0
    print("SHARDED_OK")
""")


def test_fsdp4_tp2_step_equals_single_device_step():
    env = child_env(8, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "SHARDED_OK" in proc.stdout, proc.stderr[-4000:]
