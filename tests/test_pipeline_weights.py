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
    staged = publisher.take_newer(0)
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
    staged = publisher.take_newer(2)
    assert staged.version == 3
    np.testing.assert_array_equal(np.asarray(staged.params["b"]), np.asarray(_params(3)["b"]))
    assert publisher.take_newer(2) is None  # taken once


def test_filtered_versions_are_not_published():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    publisher = Publisher(jax.tree.map(lambda _: sharding, _params(0)),
                          publishes=lambda v: v % 4 == 0)
    assert not publisher.publish(_params(1), 1)
    assert publisher.publish(_params(4), 4)
    assert publisher.wait_newer(0, timeout=0.1).version == 4
    assert publisher.wait_newer(4, timeout=0.01) is None
