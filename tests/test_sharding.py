"""Logical-axis sharding rules: specs by hand on an abstract mesh, and a real 8-device run.

The multi-device check runs in a subprocess because XLA_FLAGS must be set before jax starts.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from pipelinerl_jax import sharding
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder
from tests.tiny_models import model_config

MESH = AbstractMesh((2, 4), ("fsdp", "tp"))
CFG = model_config(model_type="qwen2", vocab_size=130, rms_norm_eps=1e-6, attention_bias=True)


def test_logical_to_spec_rules_and_fallbacks():
    spec = sharding.logical_to_spec
    assert spec(("layers", "embed", "q_heads", "head_dim"), (2, 32, 4, 8), MESH) == P(
        None, "fsdp", "tp"
    )
    # 2 kv heads do not divide over tp=4: replicated on that axis, fsdp still applies.
    assert spec(("layers", "embed", "kv_heads", "head_dim"), (2, 32, 2, 8), MESH) == P(None, "fsdp")
    # vocab 130 is not a multiple of 4.
    assert spec(("vocab", "embed"), (130, 32), MESH) == P(None, "fsdp")
    assert spec(("vocab", "embed"), (128, 32), MESH) == P("tp", "fsdp")
    # A mesh axis is used at most once per array; unknown names and None replicate.
    assert spec(("embed", "embed"), (32, 32), MESH) == P("fsdp")
    assert spec((None, "unknown"), (4, 4), MESH) == P()
    # Axes missing from the mesh are skipped (a pure-FSDP mesh).
    assert spec(("embed", "mlp"), (32, 64), AbstractMesh((8,), ("fsdp",))) == P("fsdp")
    custom = (("embed", None), ("mlp", "fsdp"))
    assert spec(("embed", "mlp"), (32, 64), MESH, custom) == P(None, "fsdp")


def test_mesh_axes_known_to_the_rules():
    assert sharding.mesh_axes() == ("tp", "fsdp") and sharding.batch_axis() == "fsdp"
    sharding.check_mesh(MESH)
    sharding.check_mesh(AbstractMesh((8,), ("fsdp",)))  # a subset of the known axes is fine
    with pytest.raises(ConfigError, match=r"mesh axes \['x'\] are unknown.*\['tp', 'fsdp'\]"):
        sharding.check_mesh(AbstractMesh((2, 4), ("fsdp", "x")))
    custom = (("embed", "x"), ("mlp", None), ("batch", "x"))
    sharding.check_mesh(AbstractMesh((2,), ("x",)), custom)
    assert sharding.mesh_axes(custom) == ("x",) and sharding.batch_axis(custom) == "x"
    assert sharding.batch_axis((("embed", "fsdp"),)) is None  # no batch rule: rows replicated
    with pytest.raises(ConfigError, match="differ in length"):
        sharding.make_mesh((1, 1), ("fsdp",))


def test_param_specs_cover_every_param():
    _, abstract = decoder.abstract_init(CFG)
    specs = sharding.param_specs(abstract, MESH)
    assert jax.tree.structure(specs) == jax.tree.structure(abstract)
    pure = {
        "/".join(map(str, k)): v.get_value() for k, v in __import__("flax").nnx.to_flat_state(specs)
    }
    assert pure["layers/q_proj"] == P(None, "fsdp", "tp")
    assert pure["layers/o_proj"] == P(None, "tp", None, "fsdp")
    assert pure["layers/down_proj"] == P(None, "tp", "fsdp")
    assert pure["lm_head"] == P("fsdp")
    assert pure["final_norm"] == P()


SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from pipelinerl_jax import sharding
    from pipelinerl_jax.models import decoder, hf_io
    sys.path.insert(0, sys.argv[2])
    from test_sharding import CFG
    mesh = sharding.make_mesh((2, 4), ("fsdp", "tp"))
    graphdef, abstract = decoder.abstract_init(CFG)
    shardings = sharding.param_shardings(abstract, mesh)
    # The trainer's route: jit(init, out_shardings=...) straight onto the mesh.
    params = jax.jit(lambda k: decoder.init_params(CFG, k), out_shardings=shardings)(jax.random.key(0))
    assert params["embed"].get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    hf_io.save_hf(sys.argv[1], CFG, params)
    params = jax.device_put(params, jax.devices()[0])
    _, _, loaded = hf_io.load_hf(sys.argv[1], shardings=shardings)
    q = loaded["layers"]["q_proj"].get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp"), q.sharding
    # Each device holds only its shard: 1/8 of the elements.
    assert q.addressable_shards[0].data.size * 8 == q.size
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (4, 8))
    ref = decoder.jit_forward(graphdef, params, tokens, positions)
    tokens_s = jax.device_put(tokens, sharding.batch_sharding(mesh, 2))
    out = decoder.jit_forward(graphdef, loaded, tokens_s, positions)
    out, ref = np.asarray(out), np.asarray(ref)
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    assert err < 1e-5, err
    print("OK", err)
""")


def test_sharded_load_and_forward_on_8_devices(tmp_path):
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "m"), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
