"""The sort-based MoE dispatch (models/moe_dispatch.py) against GShard's one-hot einsum
reference (models.moe.Experts.reference), on one device in fp32.

Oracles: the same outputs and gradients, dropless and with a capacity factor that drops; the
same (token, choice) pairs dropped; the same losses over a few training steps of the whole
model; the CPU kernel's compiled dot FLOPs are the routed rows' (within the documented padding
bound), not the reference's E x capacity slots, and the kernel is recorded."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import grouped_matmul, moe, moe_dispatch
from spmd.api import make_mesh
from spmd.estimate import flops
from spmd.parallel import hooks, traced_layout
from spmd.run import config

BATCH, LENGTH = 4, 32


def tiny(capacity_factor: float = 0.0, **overrides: object) -> moe.MoEConfig:
    preset = moe.MoEConfig(**config.preset("moe-tiny"))
    return dataclasses.replace(preset, capacity_factor=capacity_factor, **overrides)


def first_experts(cfg: moe.MoEConfig) -> moe.Experts:
    """Layer 0's experts, their router scaled up and leaning to expert 0 on `inputs` (whose
    mean is 1), so that routing is uneven and a capacity factor drops."""
    model = moe.create(cfg, 0)
    graph, state = nnx.split(model.blocks)
    experts = nnx.merge(graph, jax.tree.map(lambda a: a[0], state)).experts
    experts.router[...] = (experts.router[...] * 40.0).at[:, 0].add(0.05)
    return experts


def inputs(cfg: moe.MoEConfig) -> jax.Array:
    return 1.0 + jax.random.normal(jax.random.key(1), (BATCH, LENGTH, cfg.embed_dim))


def reference_kept(experts: moe.Experts, x: jax.Array) -> np.ndarray:
    """[b, t x k] 0/1: the pairs the one-hot reference keeps (its dispatch buffer's slots)."""
    dispatch, _, _, _ = experts.route(x)
    _, _, _, top = experts.choose(x)
    # a pair is kept where its token's dispatch row has a slot in the chosen expert
    slots = np.asarray(dispatch.sum(-1))  # [b, t, E]
    return np.take_along_axis(slots, np.asarray(top), axis=-1).reshape(x.shape[0], -1)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_sorted_dispatch_equals_the_one_hot_reference(capacity_factor):
    cfg = tiny(capacity_factor)
    experts, x = first_experts(cfg), inputs(cfg)
    want, want_stats = experts.reference(x)
    got, got_stats = experts.sort_dispatch(x)
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got - want).max()) <= 1e-5 * scale
    assert float(got_stats["dropped"]) == pytest.approx(float(want_stats["dropped"]), abs=1e-7)

    _, _, _, top = experts.choose(x)
    experts_of_pairs = top.reshape(BATCH, -1)
    kept = moe_dispatch.kept_pairs(experts_of_pairs, cfg.n_experts, cfg.capacity(LENGTH), LENGTH)
    np.testing.assert_array_equal(np.asarray(kept), reference_kept(experts, x) > 0)
    if capacity_factor:  # the capacity bites, so the comparison of drops is not vacuous
        assert 0.05 < float(got_stats["dropped"]) < 0.5, float(got_stats["dropped"])

    def loss(module: moe.Experts, path: str) -> jax.Array:
        y, stats = getattr(module, path)(x)
        return jnp.sum(y * jnp.cos(x)) + stats["aux_loss"] + stats["z_loss"]

    want_grads = jax.tree.leaves(nnx.grad(lambda m: loss(m, "reference"))(experts))
    got_grads = jax.tree.leaves(nnx.grad(lambda m: loss(m, "sort_dispatch"))(experts))
    for w, g in zip(want_grads, got_grads, strict=True):
        assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max())


def sgd_losses(cfg: moe.MoEConfig, steps: int) -> np.ndarray:
    """The whole model's training losses over `steps` plain SGD steps on one fixed batch."""
    model = moe.create(cfg, 0)
    graph, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(2), (BATCH, LENGTH + 1), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    @jax.jit
    def step(params: nnx.State) -> tuple[jax.Array, nnx.State]:
        loss, grads = jax.value_and_grad(lambda p: moe.lm_loss(nnx.merge(graph, p), batch))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    losses = []
    for _ in range(steps):
        loss, params = step(params)
        losses.append(float(loss))
    return np.array(losses)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_training_steps_match_the_reference(capacity_factor, monkeypatch):
    cfg = tiny(capacity_factor)
    got = sgd_losses(cfg, 4)
    assert hooks.notes()["moe_dispatch"].startswith("sorted, blocked grouped matmul (cpu")
    monkeypatch.setattr(moe.Experts, "__call__", moe.Experts.reference)
    want = sgd_losses(cfg, 4)
    assert want[-1] < want[0] - 0.1  # it trains, so the parity is not trivial
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cpu_kernel_computes_the_routed_rows_not_every_expert():
    """8 experts, top 2, 256 tokens: the routed rows are 512; the blocked kernel's dot FLOPs
    stay within its padding bound of them, the reference's are E / k x as many (dropless)."""
    cfg = tiny(n_experts=8, experts_per_token=2)
    experts = first_experts(cfg)
    x = jax.random.normal(jax.random.key(1), (1, 256, cfg.embed_dim))
    d, m = cfg.embed_dim, cfg.expert_dim

    def dots(path: str) -> float:
        forward = jax.jit(lambda x: getattr(experts, path)(x)[0])
        return flops.hlo_dot_flops(forward.lower(x).compile())

    router = 2 * 256 * d * cfg.n_experts
    routed = 256 * 2 * 3 * 2 * d * m  # pairs x 3 matmuls x 2 FLOPs x d x m
    pairs, padding = 512, cfg.n_experts * (moe_dispatch.BLOCK_ROWS - 1)
    sorted_flops = dots("sort_dispatch") - router
    assert routed <= sorted_flops <= routed * (pairs + padding) / pairs
    assert dots("reference") - router > 3.5 * routed  # E / k = 4 x the routed rows, and more


def test_the_gpu_kernel_path_equals_the_cpu_one():
    """The GPU / TPU branch (jax.lax.ragged_dot over the batch's pairs sorted by expert) runs
    here too (densely, as XLA:CPU lowers it): the same outputs and gradients as the blocked CPU
    kernel, with pairs dropped."""
    cfg = tiny(1.25)
    experts, x = first_experts(cfg), inputs(cfg)
    _, _, _, top = experts.choose(x)
    pairs = top.reshape(BATCH, -1)
    kept = moe_dispatch.kept_pairs(pairs, cfg.n_experts, cfg.capacity(LENGTH), LENGTH)
    assert not bool(kept.all())
    weights = (experts.w_gate[...], experts.w_up[...], experts.w_down[...])

    probe = jax.random.normal(jax.random.key(3), (*pairs.shape, cfg.embed_dim))

    def loss(kernel, x, weights):
        return jnp.sum(kernel(x, pairs, kept, *weights) * probe)

    results = [
        jax.value_and_grad(loss, argnums=(1, 2))(kernel, x, weights)
        for kernel in (moe_dispatch.blocked_swiglu, moe_dispatch.ragged_swiglu)
    ]
    (want, want_grads), (got, got_grads) = results
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for w, g in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads), strict=True):
        assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max())


def test_the_grouped_custom_vjp_equals_autodiff_of_ragged_dot():
    """models.grouped_matmul's custom VJP (the Hopper kernels' backward pass), run here with
    jax.lax's reference kernels, against autodiff of ragged_dot: values and both gradients,
    with rows past the groups (dropped pairs) coming out, and sending back, zero."""
    rows_key, w_key, dy_key = jax.random.split(jax.random.key(3), 3)
    rows = jax.random.normal(rows_key, (40, 8))
    w = jax.random.normal(w_key, (3, 8, 5))
    dy = jax.random.normal(dy_key, (40, 5))
    sizes = jnp.array([7, 0, 25], jnp.int32)  # an empty group; rows 32..39 in none

    def plain(rows, w):
        out = jax.lax.ragged_dot(rows, w, sizes)
        return jnp.where((jnp.arange(40) < 32)[:, None], out, 0)

    def custom(rows, w):
        return grouped_matmul.grouped(rows, w, sizes, grouped_matmul.REFERENCE)

    want, want_vjp = jax.vjp(plain, rows, w)
    got, got_vjp = jax.vjp(custom, rows, w)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.asarray(got[32:]).any()
    for g, r in zip(got_vjp(dy), want_vjp(dy), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    assert not np.asarray(got_vjp(dy)[0][32:]).any()


def test_the_hopper_kernels_fit_the_qwen3_moe_shape_and_refuse_fp32():
    """The Mosaic kernels' tile rule: Qwen3-30B-A3B's experts (2048 -> 768 and back) fit in
    bf16; fp32 (these tests' dtype) and moe-tiny's dims do not, so they take another path."""
    assert grouped_matmul.hopper_fits(2048, 768, jnp.bfloat16)
    assert grouped_matmul.hopper_fits(768, 2048, jnp.bfloat16)
    assert not grouped_matmul.hopper_fits(2048, 768, jnp.float32)
    assert not grouped_matmul.hopper_fits(32, 64, jnp.bfloat16)
    assert grouped_matmul.kernel_name(2048, 768, jnp.bfloat16) == "jax.lax.ragged_dot"  # cpu


def test_the_gpu_path_runs_per_device_under_the_auto_executor():
    """Under the auto executor the GPU / TPU branch sorts each device's own pairs
    (hooks.per_shard, as grouped_swiglu calls it): the batch-wide sort and a Pallas call are
    nothing XLA can partition. dp=4: the same outputs as one device, and no all-gather of the
    tokens (the compiled program has none at all: the weights are replicated here)."""
    cfg = tiny(1.25)
    experts, x = first_experts(cfg), inputs(cfg)
    _, _, _, top = experts.choose(x)
    pairs = top.reshape(BATCH, -1)
    kept = moe_dispatch.kept_pairs(pairs, cfg.n_experts, cfg.capacity(LENGTH), LENGTH)
    weights = (experts.w_gate[...], experts.w_up[...], experts.w_down[...])
    mesh = make_mesh("dp=4")
    tokens, rows = (NamedSharding(mesh, PartitionSpec("data")) for _ in range(2))

    def sharded(x, pairs, kept, *weights):
        with traced_layout.activation_layout(mesh, 0):
            names = (("batch", None, None), ("batch", None), ("batch", None), *[(None,) * 3] * 3)
            return hooks.per_shard(
                moe_dispatch.ragged_swiglu, x, pairs, kept, *weights, names=names
            )

    step = jax.jit(sharded, in_shardings=(tokens, rows, rows, None, None, None))
    assert "all-gather" not in step.lower(x, pairs, kept, *weights).compile().as_text()
    want = moe_dispatch.ragged_swiglu(x, pairs, kept, *weights)
    np.testing.assert_allclose(step(x, pairs, kept, *weights), want, rtol=1e-5, atol=1e-6)
