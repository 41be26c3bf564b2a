"""The router's choice: from router logits to the experts each token runs and their weights,
as today's MoE releases route (the MoEConfig fields named below; docs/strategies/moe.md).

    scores    router_score "softmax" (Mixtral, Qwen3-MoE): softmax over the experts;
              "sigmoid" (DeepSeek-V3, GLM-4.5): an independent sigmoid per expert
    choosing  the top experts_per_token by score, plus the per-expert correction bias
              (router_bias, DeepSeek-V3's e_score_correction_bias: it changes which experts
              are chosen, never their weights); with n_group > 1 only among the experts of
              the topk_group best groups (of n_group equal groups, each scored by the sum of
              its two best biased scores: DeepSeek-V3's group-limited routing)
    weights   the chosen experts' scores (without the bias), rescaled to sum to one when
              norm_topk_prob, then times routed_scaling_factor

Ineligible groups' experts are set to -inf before the top k (DeepSeek-V3's inference code;
transformers fills 0.0, which differs only where an eligible expert's biased score is below
0). A group's score is always its two best (transformers' rule; DeepSeek's own code takes the
group's best alone when the model has no bias). check_routing refuses a k larger than the
eligible experts, so the chosen are eligible. Ties go to the lower index everywhere
(`top_k`). With softmax, no bias and one group, the computation is the one it was before these
options (the same ops, the same bits).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from spmd.errors import UsageError
from spmd.parallel.hooks import batch_mean, sequence_sum, token_mean

if TYPE_CHECKING:
    from models.moe import MoEConfig

SCORES = ("softmax", "sigmoid")
AUX_SCOPES = ("batch", "sequence")  # what the load-balancing loss balances (balance_loss)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` along the last dim (largest first, ties to the lower index), as a stable
    sort: XLA's partitioner replicates a top_k over its leading dims, so under jit the router
    all-gathered the whole global batch's probabilities on every data-parallel device and routed
    them all there, in every layer (and again in the backward pass under remat); a sort keeps
    each device to its own tokens."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    # -x is exact, and a stable ascending sort of it keeps equal values in index order
    negated, order = jax.lax.sort((-x, index), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    return -negated[..., :k], order[..., :k]


def group_limited(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """`choice` [..., E] with every expert outside the `topk_group` best of `n_group` equal,
    contiguous groups set to -inf; a group's score is the sum of its two best entries (its one
    entry where a group holds a single expert)."""
    *lead, n = choice.shape
    size = n // n_group
    grouped = choice.reshape(*lead, n_group, size)
    group_scores = top_k(grouped, min(2, size))[0].sum(axis=-1)  # [..., n_group]
    best = top_k(group_scores, topk_group)[1]  # [..., topk_group]
    eligible = jax.nn.one_hot(best, n_group, dtype=jnp.bool_).any(axis=-2)  # [..., n_group]
    mask = jnp.broadcast_to(eligible[..., None], grouped.shape).reshape(choice.shape)
    return jnp.where(mask, choice, -jnp.inf)


def choose(
    cfg: MoEConfig, logits: jax.Array, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [..., E] fp32 (and the correction bias [E] or None) -> (probabilities [..., E],
    the top k's weights [..., k], their experts [..., k]). The probabilities are what the
    load-balancing loss averages: the softmax, or the sigmoid scores normalised to sum to one
    per token."""
    k = cfg.experts_per_token
    if cfg.router_score == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(axis=-1, keepdims=True)
    if bias is None and cfg.n_group == 1:
        weights, experts = top_k(scores, k)
    else:  # the bias and the groups only choose: no gradient flows through the choice
        choice = jax.lax.stop_gradient(scores)
        if bias is not None:
            choice = choice + jax.lax.stop_gradient(bias).astype(jnp.float32)
        if cfg.n_group > 1:
            choice = group_limited(choice, cfg.n_group, cfg.topk_group)
        experts = top_k(choice, k)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        total = weights.sum(axis=-1, keepdims=True)
        # sigmoid's scores may all be tiny: transformers' DeepSeek-V3 adds 1e-20 to the sum
        weights = weights / (total if cfg.router_score == "softmax" else total + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return probs, weights, experts


@jax.custom_vjp
def load_feedback(weights: jax.Array, bias: jax.Array, load: jax.Array) -> jax.Array:
    """`weights` as they are; the differentiation gives `bias` [E] the gradient load - its
    mean (`load` [E]: the batch's choices per expert), which the step turns into DeepSeek-V3's
    update bias += rate x sign(mean - load) (spmd.engine.optimizers.with_sign_rule). A
    gradient is the one channel through which every executor, accumulation and pipeline
    schedule already carries something from the forward pass to the update (mean-reduced over
    micro-batches and devices, which keeps the sign of the global batch's deviation)."""
    del bias, load
    return weights


def _feedback_forward(
    weights: jax.Array, bias: jax.Array, load: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return weights, (bias, load)


def _feedback_backward(
    saved: tuple[jax.Array, jax.Array], grad: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    bias, load = saved
    # (x * 0 + ...: the cotangents keep their inputs' types, varying over a shard_map's axes
    # where the bias is)
    deviation = bias * 0 + (load - load.mean()).astype(bias.dtype)
    return grad, deviation, load * 0


load_feedback.defvjp(_feedback_forward, _feedback_backward)


def balance_loss(
    cfg: MoEConfig, per_token: jax.Array, probs: jax.Array, share: jax.Array
) -> jax.Array:
    """The layer's load-balancing loss from the choices per token [b, t, E] (k ones per
    token), the probabilities [b, t, E] and the global batch's share of choices per expert
    [E] (f_e, summing to k).

    aux_loss_scope "batch" (Switch / Mixtral): E x sum_e f_e P_e over the global batch, P_e
    the batch's mean probability of e (k at an even load). "sequence" (DeepSeek-V3's
    complementary sequence-wise balance loss): per sequence, sum_e f_e P_e with f_e = E / (k T)
    x the sequence's choices of e and P_e its T tokens' mean probability of e (1 at an even
    load), averaged over the global batch's sequences. A sequence split by context
    parallelism sums its chunks' counts (sequence_sum), so every layout computes the same."""
    n = cfg.n_experts
    if cfg.aux_loss_scope == "batch":  # the ops of before the option, bit for bit
        return n * jnp.sum(share * token_mean(probs.mean(axis=(0, 1))))
    counts = sequence_sum(per_token.sum(axis=1))  # [b, E]: each sequence's choices per expert
    choices = counts.sum(axis=-1, keepdims=True)  # [b, 1]: k T
    f = jax.lax.stop_gradient(n * counts / choices)  # (counts carry no gradient anyway)
    p = sequence_sum(probs.sum(axis=1)) * cfg.experts_per_token / choices  # [b, E]
    return batch_mean(jnp.sum(f * p, axis=-1).mean())


def options_set(cfg: MoEConfig) -> list[str]:
    """The routing options `cfg` sets away from the softmax top-k (as `field value`): what a
    Hugging Face export to an architecture without them names when it refuses."""
    defaults = {
        "router_score": "softmax",
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "router_bias": False,
    }
    return [f"{k} {getattr(cfg, k)}" for k, v in defaults.items() if getattr(cfg, k) != v]


def check_routing(cfg: MoEConfig) -> None:
    """UsageError, one line naming the value and what is valid, for routing fields that cannot
    run: an unknown score or aux-loss scope, groups that do not split the experts evenly, more
    groups kept than exist, more experts per token than the kept groups hold, a scaling factor
    that is not a finite positive number. Called by models.moe.check."""
    n, k, groups, kept = cfg.n_experts, cfg.experts_per_token, cfg.n_group, cfg.topk_group
    if cfg.aux_loss_scope not in AUX_SCOPES:
        raise UsageError(
            f"--aux-loss-scope {cfg.aux_loss_scope!r} must be one of {', '.join(AUX_SCOPES)}"
        )
    if cfg.router_score not in SCORES:
        raise UsageError(f"--router-score {cfg.router_score!r} must be one of {', '.join(SCORES)}")
    if not 0 < cfg.routed_scaling_factor < math.inf:
        raise UsageError(
            f"--routed-scaling-factor {cfg.routed_scaling_factor} must be a finite number > 0 "
            f"(1: the weights as routed)"
        )
    if not 0 <= cfg.router_bias_rate < math.inf:
        raise UsageError(
            f"--router-bias-rate {cfg.router_bias_rate} must be a finite number >= 0 (0: the "
            f"bias stays as loaded)"
        )
    if cfg.router_bias_rate and not cfg.router_bias:
        raise UsageError(
            f"--router-bias-rate {cfg.router_bias_rate} updates the correction bias: it needs "
            f"--router-bias true"
        )
    if groups < 1 or n % groups:
        raise UsageError(
            f"--n-group {groups} must divide --n-experts {n} into equal groups (1: no groups)"
        )
    if not 1 <= kept <= groups:
        raise UsageError(f"--topk-group {kept} must be between 1 and --n-group {groups}")
    if k > kept * (n // groups):
        raise UsageError(
            f"--experts-per-token {k} exceeds the {kept * (n // groups)} experts of the "
            f"--topk-group {kept} groups kept (of --n-group {groups}, {n // groups} experts each)"
        )
