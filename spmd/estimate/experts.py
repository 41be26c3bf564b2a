"""The arithmetic of an MoE layer's experts, shared by the planner (spmd.estimate.cost, .shape,
.timing) and the compiled-step figures (spmd.estimate.theory): one source of each formula.

Pure arithmetic, no JAX. `model` is anything with the MoE fields (models.moe.MoEConfig's names:
n_experts, experts_per_token, capacity_factor, embed_dim); `sizes` maps mesh axis -> size.
Counts are parameters or elements, bytes are bytes per device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from spmd.parallel import rules
from spmd.parallel.mesh import BATCH_AXES


def capacity(model: Any, seq_len: int) -> int:
    """(token, choice) pairs one expert takes per sequence: the sequence length when dropless,
    else ceil(capacity_factor x seq_len x k / E), at most seq_len."""
    if model.capacity_factor <= 0:
        return seq_len
    wanted = model.capacity_factor * seq_len * model.experts_per_token / model.n_experts
    return min(seq_len, math.ceil(wanted))


def expert_axes(sizes: Mapping[str, int]) -> list[str]:
    """The mesh axes of size > 1 that split the experts (spmd.parallel.rules: expert, fsdp)."""
    return [a for a in rules.BASE_RULES["expert"] if sizes.get(a, 1) > 1]


def all_to_all(
    model: Any,
    sizes: Mapping[str, int],
    global_batch: int,
    seq_len: int,
    accum: int,
    remat: bool,
    element_bytes: int,
) -> dict[str, int]:
    """{"count", "bytes", "bytes_per_layer", "group"} of the MoE token all-to-alls of one step per
    device ({} without experts or when no mesh axis splits them). Each one moves a buffer of
    experts x rows x capacity x embed elements (rows: this device's sequences per
    micro-batch): 4 per layer and micro-batch (dispatch and combine, forward and backward),
    2 more when the backward replays the forward (remat). `bytes` is the result of each op,
    summed over the step (spmd.estimate.hlo's convention)."""
    axes = expert_axes(sizes)
    if not getattr(model, "n_experts", 0) or not axes:
        return {}
    rows = global_batch // math.prod(sizes.get(a, 1) for a in BATCH_AXES) // accum
    buffer = model.n_experts * rows * capacity(model, seq_len) * model.embed_dim
    calls = accum * (4 + (2 if remat else 0))
    per_layer = calls * buffer * element_bytes
    return {
        "count": calls * model.n_layers,
        "bytes": per_layer * model.n_layers,
        "bytes_per_layer": per_layer,
        "group": math.prod(sizes[a] for a in axes),
    }


def expert_params(model: Any) -> int:
    """Parameters of all routed experts of all layers (three SwiGLU matrices each)."""
    n = getattr(model, "n_experts", 0)
    width = getattr(model, "expert_mlp_dim", 0) or model.mlp_dim
    return model.n_layers * n * 3 * model.embed_dim * width


def active_mlp_params(model: Any) -> int:
    """MLP params one token uses in one layer: the router, k experts and the shared one (the
    dense MLP without experts)."""
    n = getattr(model, "n_experts", 0)
    if not n:
        return 3 * model.embed_dim * model.mlp_dim
    width = model.expert_mlp_dim or model.mlp_dim
    routed = model.experts_per_token + int(model.shared_expert)
    return model.embed_dim * n + routed * 3 * model.embed_dim * width


def padding_flops_per_token(model: Any, seq_len: int) -> tuple[float, float]:
    """(forward, backward) FLOPs per token and layer that an MoE layer executes beyond its
    active params (models/moe.py's fixed-shape routing): each expert runs all `capacity`
    slots of every sequence, used or not (E x capacity / seq_len slots per token instead of k:
    in dropless mode E / k times the active experts' work; backward twice the forward), and
    the one-hot dispatch and combine einsums, 2 x E x capacity x embed each forward; backward,
    the dispatch's gradient flows to the tokens only (its one-hots carry none), the combine's
    to both operands (its weights are the router's). (0, 0) without experts."""
    n = getattr(model, "n_experts", 0)
    if not n:
        return 0.0, 0.0
    width, e = model.expert_mlp_dim or model.mlp_dim, model.embed_dim
    slots = n * capacity(model, seq_len) / seq_len
    experts = 6 * e * width * (slots - model.experts_per_token)
    einsum = 2 * n * capacity(model, seq_len) * e
    return experts + 2 * einsum, 2 * experts + 3 * einsum
