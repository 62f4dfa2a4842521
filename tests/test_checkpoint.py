"""RunCheckpointer: bit-exact round trips of a real TrainState, keep-last-K, corrupt steps,
structure checks, config compatibility, and restoring onto an 8-device mesh (subprocess).

The TrainState comes from pipelinerl_jax.train.trainer on a tiny Llama; every leaf (params, Adam
moments, counters) is replaced by random values so that a swapped, zeroed or re-initialised
leaf cannot pass.
"""

import dataclasses
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder
from pipelinerl_jax.rl.config import LossConfig
from pipelinerl_jax.train import checkpoint as ck
from pipelinerl_jax.train.config import TrainerConfig
from pipelinerl_jax.train.json_items import model_config_from_json
from pipelinerl_jax.train.pytree_dicts import abstract_state, as_abstract
from pipelinerl_jax.train.resume_compat import check_compatible
from pipelinerl_jax.train.trainer import Trainer, TrainState, trainer_mesh
from tests.tiny_models import model_config

CFG = model_config()


def randomize(state, seed):
    """Every leaf replaced by random values of its dtype, on its sharding."""
    rng = np.random.default_rng(seed)

    def one(x):
        if np.issubdtype(x.dtype, np.integer):
            value = rng.integers(1, 1000, x.shape).astype(x.dtype)
        else:
            value = rng.standard_normal(x.shape).astype(x.dtype)
        return jax.device_put(value, x.sharding)

    return jax.tree.map(one, state)


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(host(a), host(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.fixture(scope="module")
def setup():
    graphdef, params = decoder.init(CFG, jax.random.key(0))
    abstract_params = jax.eval_shape(lambda: params)
    trainer = Trainer(TrainerConfig(), graphdef, abstract_params, trainer_mesh())
    state = trainer.init_state(params)
    abstract = abstract_state(trainer, abstract_params)
    return trainer, state, abstract


EXTRA = {
    "config": {"model": {"hf_dir": ""}, "trainer": {"learning_rate": 1e-3}},
    "data": {"next_index": 17, "grain": '{"x": 1}'},
    "admission_started": 9,
    "pending": [
        {
            "index": 8,
            "rewards": [0.25, 1.0],
            "logprobs": [-0.123456789012345],
            "text": "naïve ∑ \\boxed{1}",
        }
    ],
    "rng": [1, 2**40],
}


def test_round_trip_bit_identical(setup, tmp_path):
    trainer, state, abstract = setup
    saved = randomize(state, 1)
    with ck.RunCheckpointer(tmp_path, model_config=CFG) as ckpt:
        assert ckpt.save(7, saved, EXTRA)
        assert not ckpt.save(7, saved, EXTRA)  # already there: nothing written
    step, restored, extra = ck.RunCheckpointer(tmp_path).restore_latest(abstract)
    assert step == 7 and extra == EXTRA
    assert_bit_identical(restored, saved)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(trainer.state_shardings)):
        assert got.sharding == want
    meta = ck.RunCheckpointer(tmp_path).read_json(7, "meta")
    assert model_config_from_json(meta["model_config"]) == CFG
    # Params alone (what export reads), onto a fresh model's structure.
    params = ck.RunCheckpointer(tmp_path).restore_params(7, decoder.abstract_init(CFG)[1])
    assert_bit_identical(params, saved.params)


def test_async_save_survives_donation(setup, tmp_path):
    """save() returns once arrays are off the device: deleting them (as donation does) is safe."""
    _, state, abstract = setup
    saved = randomize(state, 2)
    expected = host(saved)
    ckpt = ck.RunCheckpointer(tmp_path, async_save=True)
    ckpt.save(1, saved, {})
    for x in jax.tree.leaves(saved):
        x.delete()
    ckpt.close()
    _, restored, _ = ck.RunCheckpointer(tmp_path).restore_latest(abstract)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(host(restored), expected))


def test_on_cpu_a_save_is_synchronous_and_bounded_by_the_largest_leaf(setup, tmp_path):
    """CPU: no background copy of the state; the bound covers two f32 copies of the model's
    largest leaf; the step is on disk when save returns, and restores bit for bit."""
    _, state, abstract = setup
    saved = randomize(state, 5)
    ckpt = ck.RunCheckpointer(tmp_path, model_config=CFG)
    assert ckpt.async_save is False
    largest = max(x.size for x in jax.tree.leaves(decoder.abstract_init(CFG)[1])) * 4
    assert ckpt.save_inflight_bytes == max(2 * largest, ck._MIN_INFLIGHT_BYTES)
    assert ckpt.save(1, saved, {"step": 1})
    assert (tmp_path / "checkpoints" / "1").is_dir()  # written, not pending
    ckpt.close()
    _, restored, extra = ck.RunCheckpointer(tmp_path).restore_latest(abstract)
    assert_bit_identical(restored, saved)
    assert extra == {"step": 1}


def test_a_leaf_larger_than_the_bound_is_refused_before_anything_is_written(setup, tmp_path):
    _, state, _ = setup
    largest = max(x.nbytes for x in jax.tree.leaves(state))
    ckpt = ck.RunCheckpointer(tmp_path, async_save=False, save_inflight_bytes=largest - 1)
    with pytest.raises(ConfigError, match=r"has \d+ bytes, more than save_inflight_bytes=") as e:
        ckpt.save(1, randomize(state, 1), {})
    assert "\n" not in str(e.value)
    ckpt.close()
    assert ck.RunCheckpointer(tmp_path).steps() == []
    assert not any("tmp" in p for p in os.listdir(tmp_path / "checkpoints"))


_BOUNDED = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp
    from bench.rss_trace import RssTrace, rss_bytes
    from pipelinerl_jax import glibc_malloc
    from pipelinerl_jax.train import checkpoint as ck
    from pipelinerl_jax.train.trainer import TrainState
    glibc_malloc.limit_arenas()
    key = jax.random.key(0)
    def z():
        return jnp.zeros((), jnp.int32)
    leaves = {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (4096, 1024))
              for i in range(16)}                               # 16 leaves of 16 MiB
    state = TrainState(step=z(), version=z(), params=leaves, opt_state=(), ref_params=None,
                       skipped=z(), consecutive_skips=z())
    jax.block_until_ready(state)
    grown = []
    for bound in (2 * 16 * 2**20, None):                        # two leaves, unbounded
        glibc_malloc.release()
        base = rss_bytes(os.getpid())
        with RssTrace(os.getpid(), None, interval_s=0.002) as trace:
            with ck.RunCheckpointer(f"{sys.argv[1]}/{bound}", async_save=False,
                                    save_inflight_bytes=bound) as ckpt:
                ckpt.save(1, state, {})
        grown.append((trace.peak_bytes - base) / 2**20)
    print(*grown)
""")


def test_a_bounded_save_holds_a_fraction_of_the_state(tmp_path):
    """A 256 MiB state saved with a bound of two leaves grows the process by well under half
    of it; unbounded, the same save holds most of a second copy (the contrast shows the
    measurement can tell)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", _BOUNDED, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=root,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    bounded_mib, unbounded_mib = map(float, out.stdout.split())
    assert bounded_mib < 96, (bounded_mib, unbounded_mib)
    assert unbounded_mib > 128, (bounded_mib, unbounded_mib)


def test_keep_last_k(setup, tmp_path):
    _, state, abstract = setup
    with ck.RunCheckpointer(tmp_path, keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, randomize(state, step), {"step": step})
    ckpt = ck.RunCheckpointer(tmp_path, keep=2)
    assert ckpt.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "4"]
    step, restored, extra = ckpt.restore_latest(abstract)
    assert (step, extra) == (4, {"step": 4})
    assert_bit_identical(restored, randomize(state, 4))


def _truncate_data(step_dir):
    files = [f for f in glob.glob(f"{step_dir}/params/**/d/*", recursive=True)]
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)


def _write(path, text):
    with open(path, "w") as fh:
        fh.write(text)


CORRUPTIONS = {
    "truncated_arrays": _truncate_data,
    "deleted_meta": lambda d: os.remove(f"{d}/meta/metadata"),
    "bad_extra_json": lambda d: _write(f"{d}/extra/metadata", '{"pending": [1, 2'),
    "missing_train_item": lambda d: __import__("shutil").rmtree(f"{d}/train"),
    "empty_step_dir": lambda d: [__import__("shutil").rmtree(d), os.mkdir(d)],
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_latest_falls_back(setup, tmp_path, caplog, kind):
    _, state, abstract = setup
    with ck.RunCheckpointer(tmp_path) as ckpt:
        for step in (10, 20):
            ckpt.save(step, randomize(state, step), {"step": step})
    CORRUPTIONS[kind](str(tmp_path / "checkpoints" / "20"))
    ckpt = ck.RunCheckpointer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pipelinerl_jax.train.checkpoint"):
        step, restored, extra = ckpt.restore_latest(abstract)
    assert (step, extra) == (10, {"step": 10})
    assert_bit_identical(restored, randomize(state, 10))
    text = caplog.text
    assert "checkpoint step 20 is corrupt" in text and "resuming from checkpoint step 10" in text
    # The bad step is moved aside, so the run can save step 20 again.
    assert ckpt.steps() == [10]
    assert len(os.listdir(tmp_path / ck.CORRUPT_DIR)) == 1
    assert ckpt.save(20, state, {"step": "again"})
    ckpt.close()
    assert ck.RunCheckpointer(tmp_path).restore_latest(abstract)[2] == {"step": "again"}


def test_all_corrupt_or_none(setup, tmp_path, caplog):
    _, state, abstract = setup
    assert ck.RunCheckpointer(tmp_path / "fresh").restore_latest(abstract) is None
    with ck.RunCheckpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state, {})
    for step in (1, 2):
        _truncate_data(str(tmp_path / "checkpoints" / str(step)))
    with caplog.at_level(logging.WARNING, logger="pipelinerl_jax.train.checkpoint"):
        assert ck.RunCheckpointer(tmp_path).restore_latest(abstract) is None
    assert "none of the 2 checkpoints" in caplog.text
    assert ck.RunCheckpointer(tmp_path).steps() == []


def test_structure_mismatch_is_a_config_error(setup, tmp_path):
    """A changed model is not corruption: no fallback, no quarantine, a one-line error."""
    trainer, state, _ = setup
    with ck.RunCheckpointer(tmp_path) as ckpt:
        ckpt.save(5, state, {})
    wider = dataclasses.replace(CFG, intermediate_size=96)
    graphdef, abstract_params = decoder.abstract_init(wider)
    other = Trainer(TrainerConfig(), graphdef, abstract_params, trainer_mesh())
    with pytest.raises(
        ConfigError,
        match=r"down_proj.*float32\(2, 64, 32\).*\(2, 96, 32\).*"
        r"new --workdir",
    ) as e:
        ck.RunCheckpointer(tmp_path).restore_latest(abstract_state(other, abstract_params))
    assert "\n" not in str(e.value)
    # A KL term adds frozen reference params to the state: also a changed structure.
    with_ref = Trainer(
        TrainerConfig(loss=LossConfig(kl_coef=0.1)),
        trainer.graphdef,
        jax.eval_shape(lambda: state.params),
        trainer_mesh(),
    )
    with pytest.raises(ConfigError, match="ref_params"):
        ck.RunCheckpointer(tmp_path).restore_latest(
            abstract_state(with_ref, jax.eval_shape(lambda: state.params))
        )
    assert ck.RunCheckpointer(tmp_path).steps() == [5]


def test_extra_must_be_json(setup, tmp_path):
    _, state, _ = setup
    with ck.RunCheckpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match=r"extra\.pending\[0\]\.problem is a object"):
            ckpt.save(1, state, {"pending": [{"problem": object()}]})
        assert ckpt.steps() == []


def _config(**changes):
    cfg = {
        "seed": 0,
        "mode": "pipeline",
        "group_size": 8,
        "batch_size": 64,
        "steps": 400,
        "conventional_steps": 4,
        "max_lag": 2,
        "log_every": 20,
        "model": {
            "hf_dir": "",
            "param_dtype": "float32",
            "init": [["hidden_size", 128], ["num_layers", 2]],
        },
        "data": {
            "task": "reverse_digits",
            "task_options": [["max_digits", 5]],
            "datasets": [],
            "shuffle_seed": 0,
        },
        "trainer": {
            "learning_rate": 3e-3,
            "grad_clip_norm": 1.0,
            "loss": {"kl_coef": 0.0, "kl_coef_end": None},
        },
    }
    for path, value in changes.items():
        node = cfg
        *parents, last = path.split("/")
        for p in parents:
            node = node[p]
        node[last] = value
    return json.loads(json.dumps(cfg))


def test_check_compatible_allows_harmless_changes():
    assert check_compatible(_config(), _config()) == []
    changes = check_compatible(
        _config(),
        _config(
            **{
                "trainer/learning_rate": 1e-3,
                "steps": 800,
                "log_every": 5,
                "max_lag": 4,
                "trainer/grad_clip_norm": 0.5,
            }
        ),
    )
    assert changes == [
        "log_every: 20 -> 5",
        "max_lag: 2 -> 4",
        "steps: 400 -> 800",
        "trainer.grad_clip_norm: 1.0 -> 0.5",
        "trainer.learning_rate: 0.003 -> 0.001",
    ]
    # Conventional rounds only matter in conventional mode.
    assert check_compatible(_config(), _config(conventional_steps=8)) == [
        "conventional_steps: 4 -> 8"
    ]


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"model/init": [["hidden_size", 256], ["num_layers", 2]]}, "model.init.hidden_size"),
        ({"model/param_dtype": "bfloat16"}, "model.param_dtype"),
        ({"model/hf_dir": "/models/qwen"}, "model.hf_dir"),
        ({"group_size": 4}, "group_size"),
        ({"batch_size": 32}, "batch_size"),
        ({"mode": "conventional"}, "mode"),
        ({"data/task_options": [["max_digits", 6]]}, "data.task_options.max_digits"),
        ({"data/shuffle_seed": 1}, "data.shuffle_seed"),
        ({"trainer/grad_clip_norm": 0.0}, "trainer.grad_clip_norm"),
        ({"trainer/loss/kl_coef": 0.01}, "trainer.loss.kl_coef"),
    ],
)
def test_check_compatible_refuses_breaking_changes(changes, field):
    with pytest.raises(ConfigError, match=rf"config\.{field} changed .*new --workdir") as e:
        check_compatible(_config(), _config(**changes))
    assert "\n" not in str(e.value)
    # Both directions.
    with pytest.raises(ConfigError, match=rf"config\.{field} changed"):
        check_compatible(_config(**changes), _config())


def test_conventional_round_change_refused_in_conventional_mode():
    with pytest.raises(ConfigError, match="conventional_steps"):
        check_compatible(
            _config(mode="conventional"), _config(mode="conventional", conventional_steps=2)
        )


_SHARDED = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint import CFG, assert_bit_identical, randomize
    from pipelinerl_jax.train import checkpoint as ck
    from pipelinerl_jax.train.pytree_dicts import abstract_state
    from pipelinerl_jax.models import decoder
    from pipelinerl_jax.train.trainer import Trainer, trainer_mesh
    from pipelinerl_jax.train.config import TrainerConfig
    assert len(jax.devices()) == 8
    graphdef, abstract_params = decoder.abstract_init(CFG)
    trainer = Trainer(TrainerConfig(), graphdef, abstract_params, trainer_mesh(tp=2))
    step, state, extra = ck.RunCheckpointer(sys.argv[1]).restore_latest(
        abstract_state(trainer, abstract_params))
    sharded = 0
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
        assert got.sharding == want, (got.sharding, want)
        sharded += len(got.sharding.device_set) == 8 and not got.sharding.is_fully_replicated
    assert sharded > 10, sharded
    expected = np.load(os.path.join(sys.argv[1], "expected.npz"))
    for i, leaf in enumerate(jax.tree.leaves(state)):
        assert np.asarray(leaf).tobytes() == expected[str(i)].tobytes(), i
    # And back: save from the 8-device layout, restore it unchanged.
    ckpt = ck.RunCheckpointer(sys.argv[1])
    ckpt.save(step + 1, state, extra)
    ckpt.close()
    again = ck.RunCheckpointer(sys.argv[1]).restore_latest(abstract_state(trainer,
                                                                            abstract_params))
    assert again[0] == step + 1
    assert_bit_identical(again[1], state)
    print("OK", step, sharded)
""")


def test_restore_onto_8_device_mesh(setup, tmp_path):
    """Saved from one device, restored directly onto an fsdp=4 x tp=2 layout (and back)."""
    _, state, _ = setup
    saved = randomize(state, 3)
    with ck.RunCheckpointer(tmp_path) as ckpt:
        ckpt.save(3, saved, {"k": 1})
    np.savez(tmp_path / "expected.npz", **{str(i): x for i, x in enumerate(host(saved))})
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED, str(tmp_path), os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 3" in out.stdout


_KILLED = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp, numpy as np
    from pipelinerl_jax.train import checkpoint as ck
    from pipelinerl_jax.train.trainer import TrainState
    def state(step, n):
        z = jnp.asarray(step, jnp.int32)
        params = {"w": jnp.asarray(np.full((n, 1024), step, np.float32))}
        return TrainState(step=z, version=z, params=params, opt_state=(), ref_params=None,
                          skipped=z, consecutive_skips=z)
    ckpt = ck.RunCheckpointer(sys.argv[1], async_save=True)
    ckpt.save(1, state(1, 8), {"step": 1})
    ckpt.wait()
    ckpt.save(2, state(2, 65536), {"step": 2})   # 256 MiB, written in the background
    print("saving", flush=True)
    time.sleep(600)                              # the parent kills it mid-write
""")


def test_killed_during_async_write(tmp_path):
    """SIGKILL from outside while step 2's write is in progress (its temporary directory
    exists): step 2 is absent, step 1 restores whole, and the leftover is swept."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=root,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    ckpts, deadline, in_progress = tmp_path / "checkpoints", time.time() + 120, []
    while not in_progress:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline, "step 2's write never started"
        if ckpts.is_dir():
            in_progress = [d for d in os.listdir(ckpts) if d.startswith("2.") and "tmp" in d]
        time.sleep(0.001)
    proc.kill()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (ckpts / "2").exists(), "the write finished before the kill; enlarge it"
    ckpt = ck.RunCheckpointer(tmp_path)
    assert ckpt.steps() == [1]
    z = np.int32(0)
    like = TrainState(
        step=z,
        version=z,
        params={"w": np.zeros((8, 1024), np.float32)},
        opt_state=(),
        ref_params=None,
        skipped=z,
        consecutive_skips=z,
    )
    step, state, extra = ckpt.restore_latest(as_abstract(like))
    assert step == 1 and extra == {"step": 1}
    np.testing.assert_array_equal(np.asarray(state.params["w"]), 1.0)
    # Unfinished writes are swept when a run opens the directory again.
    assert not [d for d in os.listdir(tmp_path / "checkpoints") if "tmp" in d]


def test_a_failed_restore_leaves_no_traceback_noise(monkeypatch, capsys):
    """After a restore from a damaged checkpoint fails, TensorStore's late callbacks find
    Orbax's loop closed and the other arrays' read coroutines are collected unawaited: their
    reports are dropped (hundreds of traceback lines under the one-line warning), and every
    other error still reaches the hooks."""
    import sys
    import types

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(("except", value)))
    monkeypatch.setattr(sys, "unraisablehook", lambda report: seen.append(("raise", report)))
    ck.quiet_failed_restore_reports()
    ck.quiet_failed_restore_reports()  # twice: installed once
    closed = RuntimeError("Event loop is closed")
    sys.excepthook(RuntimeError, closed, None)
    leftover = types.SimpleNamespace(
        exc_value=Exception("Encountered error while reading array index"),
        object=types.SimpleNamespace(__name__="_read_array_index_and_device_put"),
    )
    sys.unraisablehook(leftover)
    other = ValueError("a real error")
    sys.excepthook(ValueError, other, None)
    report = types.SimpleNamespace(exc_value=other, object=None)
    sys.unraisablehook(report)
    assert seen == [("except", other), ("raise", report)]
