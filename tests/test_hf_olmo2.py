"""OLMo 2's own features (tests/test_conformance.py checks the hf_olmo2 fixtures' logits,
greedy tokens, round trip, training under both executors, planner, --init-from-hf through a
pipeline and what it does not compute like every family's): its q / k norms span every head,
a tied config goes to config.json and back with OLMo 2's defaults, and the llama-only switches
are refused by their flags."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import family, olmo2
from models.layers import HeadsRMSNorm
from spmd.errors import UsageError
from spmd.run import config
from tests.hf_fixtures import ONE, loaded


def test_the_q_and_k_norms_span_every_head():
    """HeadsRMSNorm is one RMS norm over heads x head_dim features (HF's flat q_norm, written
    out here in numpy), which a norm of each head alone is not."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 8)).astype(np.float32) * np.arange(1, 5)[:, None]
    scale = rng.standard_normal((4, 8)).astype(np.float32)
    with nnx.use_eager_sharding(False):  # no mesh: the params' logical names stay names
        norm = HeadsRMSNorm(4, 8, 1e-6, nnx.Rngs(0), "heads")
    norm.scale[...] = jnp.asarray(scale)
    flat_x = x.reshape(2, 3, 32)
    whole = flat_x / np.sqrt((flat_x**2).mean(-1, keepdims=True) + 1e-6)
    expected = whole.reshape(x.shape) * scale
    np.testing.assert_allclose(jax.jit(lambda v: norm(v))(x), expected, rtol=1e-5, atol=1e-5)
    each_head = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * scale
    assert np.abs(each_head - expected).max() > 0.1


def test_a_tied_config_goes_to_config_json_and_back():
    cfg = loaded("hf_olmo2_tied", ONE).model
    written = olmo2.FAMILY.hf.config_to_hf(cfg, "bfloat16", 4096)
    assert written["tie_word_embeddings"] and written["max_position_embeddings"] == 4096
    assert olmo2.config_from_hf(written, "written") == cfg
    defaults = {k: v for k, v in written.items() if k not in ("rms_norm_eps", "architectures")}
    assert olmo2.config_from_hf(defaults, "model_type only").norm_eps == 1e-5  # OLMo 2's


def test_the_llama_only_switches_are_refused_by_their_flags():
    cfg = loaded("hf_olmo2", ONE).model
    for change, flag in (
        ({"qk_norm": True}, "--qk-norm True"),
        ({"sliding_window": 4}, "--sliding-window 4"),
    ):
        with pytest.raises(UsageError, match=flag):
            olmo2.check(dataclasses.replace(cfg, **change))
    values = {**config.preset("tiny"), "family": "olmo2"}
    assert family.check_fields(values, "preset") is olmo2.Olmo2Config
