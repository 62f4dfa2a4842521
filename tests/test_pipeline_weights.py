"""The publisher stages the sampler's prepared copy of each version, newest only, handed over
once it has arrived. (That PagedSampler.prepare never aliases the trainer's donated buffers is
test_sampler_protocol.py's.)"""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.pipeline.weights import Publisher


def _params(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (8, 4)), "b": jax.random.normal(k2, (4,))}


def _copy(params):
    """A prepare that only copies (what PagedSampler.prepare does before its conversion)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.device_put(params, sharding, may_alias=False)


def test_take_newer_keeps_only_the_newest_and_counts_skips():
    publisher = Publisher(_copy)
    publisher.publish(_params(1), 1)
    publisher.publish(_params(2), 2)
    assert publisher.skipped == 1
    assert publisher.take_newer(2) is None  # not newer than what the sampler holds
    publisher.publish(_params(3), 3)
    staged = publisher.take_newer(2, when_ready=False)
    assert staged.version == 3
    np.testing.assert_array_equal(np.asarray(staged.params["b"]), np.asarray(_params(3)["b"]))
    assert publisher.take_newer(2) is None  # taken once


def test_filtered_versions_are_not_published():
    publisher = Publisher(_copy, publishes=lambda v: v % 4 == 0)
    assert not publisher.publish(_params(1), 1)
    assert publisher.publish(_params(4), 4)
    assert publisher.wait_newer(0, timeout=0.1).version == 4
    assert publisher.wait_newer(4, timeout=0.01) is None


class _Pending:
    """A leaf whose transfer has not finished yet."""

    def __init__(self):
        self.ready = False

    def is_ready(self):
        return self.ready


def test_take_newer_waits_until_every_leaf_arrived():
    from pipelinerl_jax.pipeline.weights import Staged

    publisher = Publisher(_copy)
    leaf = _Pending()
    # An arrived leaf: jnp.ones is dispatched asynchronously, and on a busy machine it may not
    # have run yet when take_newer looks.
    arrived = jnp.ones(2).block_until_ready()
    publisher._staged = Staged(params={"w": leaf, "b": arrived}, version=5, staged_at=0.0)
    assert publisher.take_newer(4) is None  # still in flight: decoding goes on with version 4
    assert publisher.take_newer(4, when_ready=False).version == 5
    publisher._staged = Staged(params={"w": leaf, "b": arrived}, version=6, staged_at=0.0)
    leaf.ready = True
    assert publisher.take_newer(5).version == 6


def test_prepare_runs_once_per_version_in_the_publishing_thread():
    """The sampler's conversion is staged with the publication (the trainer thread pays it,
    not the sampler's chunk boundary), and its output is what the sampler is handed."""
    rng = np.random.default_rng()
    scale = float(rng.uniform(2.0, 5.0))
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}
    expected = np.asarray(params["w"]) * scale
    threads = []

    def prepare(p):
        threads.append(threading.get_ident())
        return {"w_scaled": jax.device_put(p["w"], may_alias=False) * scale}

    publisher = Publisher(prepare, publishes=lambda v: v != 2)
    publisher.publish(params, version=1)
    publisher.publish(params, version=2)  # filtered: never prepared
    assert threads == [threading.get_ident()]
    jax.jit(lambda p: jax.tree.map(lambda x: x * 2.0, p), donate_argnums=0)(params)
    staged = publisher.wait_newer(0, timeout=10.0)
    assert staged.version == 1 and set(staged.params) == {"w_scaled"}
    np.testing.assert_allclose(np.asarray(staged.params["w_scaled"]), expected, rtol=1e-6)


def test_host_leaves_count_as_arrived():
    """A sampler in another process may stage host arrays: nothing to wait for."""
    publisher = Publisher(lambda p: jax.tree.map(np.asarray, p))
    publisher.publish(_params(3), 3)
    staged = publisher.take_newer(2)  # when_ready: numpy leaves have no is_ready
    assert staged is not None and staged.version == 3
    np.testing.assert_array_equal(staged.params["b"], np.asarray(_params(3)["b"]))


class _Blocking:
    """A prepared leaf that counts the waits for it."""

    def __init__(self):
        self.waits = 0

    def block_until_ready(self):
        self.waits += 1
        return self


def test_wait_prepared_waits_for_the_last_publish_once_and_then_forgets_it():
    leaves = []

    def prepare(params):
        leaves.append(_Blocking())
        return {"w": leaves[-1], "b": _copy(params)["b"]}

    publisher = Publisher(prepare)
    publisher.wait_prepared()  # nothing published yet: nothing to wait for
    publisher.publish(_params(1), 1)
    publisher.publish(_params(2), 2)
    publisher.wait_prepared()
    assert [leaf.waits for leaf in leaves] == [0, 1]  # the last publish only
    publisher.wait_prepared()
    assert leaves[1].waits == 1  # forgotten: the publisher holds no params of its own
    assert publisher.take_newer(1, when_ready=False).version == 2  # still staged for the sampler
