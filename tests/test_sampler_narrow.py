"""A publish copies params already narrowed to what decoding reads (sampler/forward.py
publish_dtypes): half the bytes of the f32 master params, and exactly the same decode params."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.models import decoder
from pipelinerl_jax.sampler import forward as fwd
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.steps import prepare_params
from tests.tiny_models import model_config


@pytest.mark.parametrize(
    "tied, head, compute, narrowed",
    [
        (False, "float32", "bfloat16", {"layers": "bfloat16", "embed": "bfloat16"}),
        (
            False,
            "bfloat16",
            "bfloat16",
            {"layers": "bfloat16", "embed": "bfloat16", "lm_head": "bfloat16"},
        ),
        (True, "float32", "bfloat16", {"layers": "bfloat16"}),  # the table also feeds the f32 head
        (True, "bfloat16", "bfloat16", {"layers": "bfloat16", "embed": "bfloat16"}),
        (False, "float32", "float32", None),  # nothing is read narrower: no cast, no copy
    ],
)
def test_narrowed_params_give_the_same_decode_params(tied, head, compute, narrowed):
    cfg = model_config(tie_word_embeddings=tied, compute_dtype=compute)
    _, params = decoder.init(cfg, jax.random.key(1))
    dtypes = fwd.publish_dtypes(cfg, params, head)
    assert dtypes == narrowed
    small = fwd.narrow_for_decode(params, dtypes or {})
    for name, dtype in (dtypes or {}).items():
        assert {x.dtype for x in jax.tree.leaves(decoder.arrays(small)[name])} == {jnp.dtype(dtype)}
    assert decoder.arrays(small)["final_norm"].dtype == jnp.float32
    for layout in ("feature_major", "token_major"):
        want = fwd.decode_params(cfg, params, layout=layout, head_dtype=head)
        got = fwd.decode_params(cfg, small, layout=layout, head_dtype=head)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_params_already_narrow_are_left_as_they_are():
    cfg = model_config(param_dtype="bfloat16", compute_dtype="bfloat16")
    _, params = decoder.init(cfg, jax.random.key(2))
    assert fwd.publish_dtypes(cfg, params, "bfloat16") is None


def test_sampler_prepare_narrows_before_the_copy():
    """The bf16 sampler of f32 params places bf16 layers on its mesh, and its prepared params
    are those of the unnarrowed conversion."""
    cfg = dataclasses.replace(model_config(), compute_dtype="bfloat16")
    graphdef, params = decoder.init(cfg, jax.random.key(3))
    sampler = PagedSampler(graphdef, params, SamplerConfig(num_slots=2, max_seq_len=32))
    assert sampler._view._narrow is not None
    prepared = sampler.prepare(params)
    direct = jax.jit(lambda p: prepare_params(p, cfg=cfg, ecfg=sampler.engine.ecfg))(params)
    for a, b in zip(jax.tree.leaves(prepared), jax.tree.leaves(direct), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
