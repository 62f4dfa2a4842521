"""The publisher copies params without aliasing the trainer's (donated) buffers."""

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.pipeline.weights import Publisher


def _params(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (8, 4)), "b": jax.random.normal(k2, (4,))}


def test_published_copy_survives_donation_of_the_source():
    params = _params(0)
    expected = jax.tree.map(np.asarray, params)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    publisher = Publisher(jax.tree.map(lambda _: sharding, params))
    assert publisher.publish(params, version=1)
    # The trainer's next step donates its params: the staged copy must not be those buffers.
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 2.0, p), donate_argnums=0)
    step(params)
    staged = publisher.wait_newer(0, timeout=10.0)
    assert staged.version == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, staged.params), expected)


def test_take_newer_keeps_only_the_newest_and_counts_skips():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    publisher = Publisher(jax.tree.map(lambda _: sharding, _params(0)))
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
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    publisher = Publisher(
        jax.tree.map(lambda _: sharding, _params(0)), publishes=lambda v: v % 4 == 0
    )
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

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    publisher = Publisher(jax.tree.map(lambda _: sharding, _params(0)))
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


def test_prepare_runs_in_the_publishing_thread_on_a_private_copy():
    """The sampler's layout conversion is staged with the copy (the trainer thread pays it,
    not the sampler's chunk boundary), and it never sees the trainer's own buffers."""
    params = _params(0)
    expected = np.asarray(params["w"]) * 3.0
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    seen = []

    def prepare(copy):
        seen.append(copy["w"])
        return {"w3": copy["w"] * 3.0}

    publisher = Publisher(jax.tree.map(lambda _: sharding, params), prepare=prepare)
    publisher.publish(params, version=1)
    assert seen and seen[0] is not params["w"]
    jax.jit(lambda p: jax.tree.map(lambda x: x * 2.0, p), donate_argnums=0)(params)
    staged = publisher.wait_newer(0, timeout=10.0)
    assert staged.prepared and staged.version == 1
    np.testing.assert_allclose(np.asarray(staged.params["w3"]), expected)
