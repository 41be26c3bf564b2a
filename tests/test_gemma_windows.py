"""Gemma's local / global layers with static windows (models/gemma2.py static_window: the
attention kernel in two branches of a lax.cond, each with its window a constant): the model
equals the former program, whose kernels took the window traced, forward and backward, and
equals the layers unrolled one by one with their windows as ints; the traced program carries
no per-layer (traced) window."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import gemma2, gemma3
from models.blockwise_attention import BLOCK_K
from spmd.parallel import hooks

LENGTH = BLOCK_K + 88  # two key blocks: the blockwise kernel, its window in range

# 5 layers of period 2 and 7 of period 6: the pattern cut short at the end of each
GEMMA2 = gemma2.Gemma2Config(
    vocab_size=64, embed_dim=16, mlp_dim=32, n_layers=5, n_heads=4, n_kv_heads=2, head_dim=8,
    attn_softcap=5.0, sliding_window=300, query_pre_attn_scalar=12.0,
)  # fmt: skip
GEMMA3 = gemma3.Gemma3Config(
    vocab_size=64, embed_dim=16, mlp_dim=32, n_layers=7, n_heads=4, n_kv_heads=2, head_dim=8,
    sliding_window=300, rope_scaling="linear", rope_factor=4.0,
)  # fmt: skip


def unrolled_blocks(model: gemma2.Gemma, x: jax.Array) -> jax.Array:
    """The blocks one after another (no scan), each told its index as a Python int: its
    window and rotary base constants, no lax.cond."""
    block_def, block_state = nnx.split(model.blocks)
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    for i in range(model.cfg.n_layers):
        state = jax.tree.map(lambda leaf, i=i: leaf[i], block_state)
        x = nnx.merge(block_def, state)(x, positions, None, i)
    return x


def traced_window(cfg: gemma2.Gemma2Config, window: jax.Array | int, attend) -> jax.Array:
    """The former program's static_window: the kernel given the window as it comes (traced
    in the layer scan)."""
    return attend(window)


def loss_and_grads(model: gemma2.Gemma, blocks, x: jax.Array) -> tuple:
    """(sum of squares of the blocks' output, its gradients in the blocks' params and x)."""
    graphdef, state = nnx.split(model)

    def loss(state: nnx.State, x: jax.Array) -> jax.Array:
        return jnp.sum(blocks(nnx.merge(graphdef, state), x) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)


@pytest.mark.parametrize(
    "cfg, remat, scanned",
    # the unrolled stack's windows are ints (no lax.cond): the forward test below covers it
    [(GEMMA2, "none", True), (GEMMA3, "full", True)],
    ids=["gemma2", "gemma3-remat-full"],
)
def test_static_windows_equal_the_traced_window_program(cfg, remat, scanned, monkeypatch):
    model = gemma2.create(dataclasses.replace(cfg, remat=remat, scan_layers=scanned), seed=0)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, LENGTH, cfg.embed_dim)), jnp.float32)
    blocks = lambda m, x: m.apply_blocks(x)  # noqa: E731
    value, grads = loss_and_grads(model, blocks, x)
    # the model's own program: static windows, no per-layer (traced) window
    assert hooks.notes()["attention"] == (
        "blockwise (soft-capping)" if cfg.attn_softcap else "blockwise"
    )
    monkeypatch.setattr(gemma2, "static_window", traced_window)
    expected, expected_grads = loss_and_grads(model, blocks, x)
    if not cfg.attn_softcap:  # the soft-cap's reason comes first in the note
        assert hooks.notes()["attention"] == "blockwise (per-layer window)"
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_the_forward_equals_the_layers_unrolled_with_int_windows_within_1e_6():
    """The whole stack of a Gemma 3 of 7 layers (a period and one more) through the layer
    scan, against the blocks called one by one with their index as an int."""
    model = gemma2.create(GEMMA3, seed=1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, LENGTH)), jnp.int32)
    x = model.embed_tokens(tokens)
    got = jax.jit(lambda x: model.apply_blocks(x))(x)
    assert hooks.notes()["attention"] == "blockwise"
    want = jax.jit(lambda x: unrolled_blocks(model, x))(x)
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got - want).max()) <= 1e-6 * scale
    short = jax.jit(lambda x: model.apply_blocks(x))(x[:, :16])  # one key block: XLA's
    assert hooks.notes()["attention"] == "xla"
    assert short.shape == (2, 16, GEMMA3.embed_dim)
