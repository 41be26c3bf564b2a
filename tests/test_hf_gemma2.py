"""Gemma 2's own features (tests/test_conformance.py checks the hf_gemma2 fixture's logits,
the soft-caps, window and score scale it depends on, greedy tokens, round trip, training and
planner like every family's): the attention kernels' general options (traced window, scale,
soft-cap) against a brute-force mask, the pipeline rule of models/gemma2.py and context
parallelism accepted (tests/test_gemma_context.py trains it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention, gemma2
from spmd.errors import UsageError
from spmd.parallel import hooks
from tests import trainer
from tests.hf_fixtures import ONE, loaded, reference

NAME = "hf_gemma2"


def test_the_attention_options_agree_with_a_brute_force_mask():
    """causal_attention with a traced window (as inside the layer scan), a score scale and a
    soft-cap equals the band, scale and tanh written out, and notes the XLA path."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, s, 8)), jnp.float32) for s in (4, 2, 2))
    scale, cap = 12**-0.5, 2.0
    for window in (3, 0):
        kernel = jax.jit(
            lambda q, k, v, w: attention.causal_attention(q, k, v, None, w, scale, cap)
        )
        fused = kernel(q, k, v, jnp.int32(window))
        assert hooks.notes()["attention"] == "xla (soft-capping)"
        i, j = np.arange(12)[:, None], np.arange(12)[None, :]
        band = jnp.asarray((j <= i) & ((j > i - window) | (window == 0)))
        logits = jnp.einsum("btkgd,bskd->bkgts", q.reshape(2, 12, 2, 2, 8), k) * scale
        logits = jnp.where(band, cap * jnp.tanh(logits / cap), -jnp.inf)
        brute = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(logits, -1), v).reshape(q.shape)
        np.testing.assert_allclose(fused, brute, rtol=0, atol=1e-5)


def test_a_pipeline_must_hold_whole_periods_of_the_local_global_pattern():
    """check_layout accepts pp=2 for 4 layers of period 2 and refuses pp=4 (1 layer per
    stage); run as two chunks of 2 layers (what pp=2 runs) the blocks equal the whole stack,
    and a chunk of 1 layer is refused while tracing."""
    source = loaded(NAME, ONE)
    cfg = source.model
    gemma2.check_layout(cfg, trainer.layout("pp=2,dp=4").mesh, "auto")
    with pytest.raises(UsageError, match="multiple of --global-every 2"):
        gemma2.check_layout(cfg, trainer.layout("pp=4,dp=2").mesh, "auto")
    model = nnx.merge(source.program.graphdef, jax.device_get(source.params))
    x = model.embed_tokens(jnp.asarray(reference(NAME)["input_ids"]))
    whole = model.apply_blocks(x)
    graphdef, state = nnx.split(model)

    def chunk(start: int, size: int) -> nnx.Module:
        def cut(path, leaf):
            return leaf[start : start + size] if path[0].key == "blocks" else leaf

        return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(cut, state))

    staged = chunk(2, 2).apply_blocks(chunk(0, 2).apply_blocks(x))
    np.testing.assert_allclose(staged, whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(UsageError, match="pipeline chunk of 1 layers"):
        chunk(0, 1).apply_blocks(x)


def test_context_parallelism_is_accepted():
    """The layout check passes cp=2 (it refused Gemma under cp before the ring took the
    window, scale and soft-cap): nothing raises."""
    cfg = loaded(NAME, ONE).model
    gemma2.check_layout(cfg, trainer.layout("dp=4,cp=2").mesh, "auto")
