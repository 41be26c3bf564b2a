"""The router's options (models/moe_routing.py): sigmoid scores, group-limited top-k, the
routed scaling factor and the per-expert correction bias.

Oracles: a routing written here in numpy, token by token, from the rules as DeepSeek-V3 states
them (scores; groups scored by their two best biased scores; top k among the kept groups'
experts; weights the unbiased scores, renormalised, scaled) chooses the same experts with the
same weights as Experts.choose; the default (softmax, no bias, no groups) is bit for bit the
formula it was before; the loss has no gradient for the bias; the sorted dispatch equals the
one-hot reference under the new options."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import moe
from spmd.run import config

BATCH, LENGTH = 4, 32
# 8 experts in 4 groups of 2, the tokens' 3 experts from their 2 best groups
ROUTED = {
    "n_experts": 8,
    "experts_per_token": 3,
    "router_score": "sigmoid",
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "router_bias": True,
}
BIAS = np.array([0.3, -0.2, 0.0, 0.25, -0.3, 0.1, 0.05, -0.1], np.float32)


def tiny(**overrides: object) -> moe.MoEConfig:
    return dataclasses.replace(moe.MoEConfig(**config.preset("moe-tiny")), **overrides)


def first_experts(cfg: moe.MoEConfig, bias: np.ndarray | None = None) -> moe.Experts:
    """Layer 0's experts, the router scaled up so that the scores spread over (0, 1)."""
    graph, state = nnx.split(moe.create(cfg, 0).blocks)
    experts = nnx.merge(graph, jax.tree.map(lambda a: a[0], state)).experts
    experts.router[...] = experts.router[...] * 40.0
    if bias is not None:
        experts.router_bias[...] = jnp.asarray(bias)
    return experts


def inputs(cfg: moe.MoEConfig) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (BATCH, LENGTH, cfg.embed_dim))


def numpy_routing(
    logits: np.ndarray, cfg: moe.MoEConfig, bias: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(experts [tokens, k], weights [tokens, k]) of logits [tokens, E], one token at a time."""
    n, k = cfg.n_experts, cfg.experts_per_token
    size = n // cfg.n_group
    experts, weights = [], []
    for row in logits.astype(np.float64):
        scores = 1.0 / (1.0 + np.exp(-row))
        biased = scores + bias
        group_scores = [
            np.sort(biased[g * size : (g + 1) * size])[-2:].sum() for g in range(cfg.n_group)
        ]
        kept = np.argsort(-np.array(group_scores), kind="stable")[: cfg.topk_group]
        candidates = [e for e in range(n) if e // size in kept]
        chosen = sorted(candidates, key=lambda e: (-biased[e], e))[:k]  # ties: lower index
        w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
        experts.append(chosen)
        weights.append(w)
    return np.array(experts), np.array(weights)


def test_sigmoid_groups_bias_and_scaling_match_a_numpy_routing():
    cfg = tiny(**ROUTED)
    experts, x = first_experts(cfg, BIAS), inputs(cfg)
    logits, probs, weights, chosen = experts.choose(x)
    logits = np.asarray(logits).reshape(-1, cfg.n_experts)
    want_experts, want_weights = numpy_routing(logits, cfg, BIAS)
    np.testing.assert_array_equal(np.asarray(chosen).reshape(-1, 3), want_experts)
    np.testing.assert_allclose(np.asarray(weights).reshape(-1, 3), want_weights, rtol=1e-6)
    # the load-balancing probabilities: the sigmoid scores normalised per token
    scores = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(
        np.asarray(probs).reshape(-1, 8), scores / scores.sum(-1, keepdims=True), rtol=1e-6
    )
    # the groups and the bias each change the choice of some tokens: the test can fail
    without_groups = numpy_routing(logits, dataclasses.replace(cfg, topk_group=4), BIAS)[0]
    without_bias = numpy_routing(logits, cfg, np.zeros_like(BIAS))[0]
    assert (without_groups != want_experts).any(axis=1).mean() > 0.05
    assert (without_bias != want_experts).any(axis=1).mean() > 0.05


def test_the_default_routing_is_bit_for_bit_the_softmax_top_k():
    for normalise in (True, False):
        cfg = tiny(norm_topk_prob=normalise)
        experts, x = first_experts(cfg), inputs(cfg)
        logits, probs, weights, chosen = experts.choose(x)
        want_probs = jax.nn.softmax(logits, axis=-1)
        top, want_experts = moe.top_k(want_probs, cfg.experts_per_token)
        want = top / top.sum(axis=-1, keepdims=True) if normalise else top
        np.testing.assert_array_equal(np.asarray(probs), np.asarray(want_probs))
        np.testing.assert_array_equal(np.asarray(weights), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(chosen), np.asarray(want_experts))


def test_the_loss_has_no_gradient_for_the_bias_and_the_router_has_one():
    cfg = tiny(**ROUTED)
    experts, x = first_experts(cfg, BIAS), inputs(cfg)
    graph, state = nnx.split(experts)

    def loss(state: nnx.State) -> jax.Array:
        y, stats = nnx.merge(graph, state)(x)
        return jnp.mean(y**2) + stats["aux_loss"]

    grads = nnx.to_pure_dict(jax.grad(loss)(state))
    assert not np.asarray(grads["router_bias"]).any()
    assert np.abs(np.asarray(grads["router"])).max() > 0


def test_sorted_dispatch_equals_the_one_hot_reference_under_the_routing_options():
    for capacity_factor in (0.0, 1.25):
        cfg = tiny(**ROUTED, capacity_factor=capacity_factor)
        experts, x = first_experts(cfg, BIAS), inputs(cfg)
        want, want_stats = experts.reference(x)
        got, got_stats = experts.sort_dispatch(x)
        scale = float(jnp.abs(want).max())
        assert float(jnp.abs(got - want).max()) <= 1e-5 * scale
        for key in ("aux_loss", "z_loss", "dropped", "load"):
            np.testing.assert_allclose(got_stats[key], want_stats[key], rtol=1e-6, atol=1e-7)
        assert (float(got_stats["dropped"]) > 0) == (capacity_factor > 0)
