"""Where a model's parameters live, as the planner sees it, and a Llama-like shape for a bare
parameter count (`--params 7e9`).

Pure arithmetic, no JAX. The model is a spmd.model_shape.ModelShape (its family builds it);
counts are parameters (scalars).
"""

from __future__ import annotations

import math
from typing import Any

from spmd.estimate import experts
from spmd.model_shape import ModelShape

# The fields that define a shape, in the order a `python -m spmd.train` command line gives them.
FIELDS = (
    "vocab_size",
    "embed_dim",
    "mlp_dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "tie_embeddings",
)


def param_groups(shape: ModelShape) -> list[tuple[int, tuple[str, ...]]]:
    """(parameter count, mesh axes other than ZeRO's fsdp that split it) for each kind of param,
    following spmd.parallel.rules: matrices split over tensor, stacked layers over pipeline.
    Every param has an `embed` dim, which ZeRO shards over fsdp, except an MoE's routed
    experts (EXPERT_AXES: split over expert and fsdp at ZeRO 1-3). The embedding and head
    stay whole over pipeline (spmd.parallel.pipeline keeps them on every stage). The q, k, v
    biases and q, k norms have no `embed` dim: ZeRO leaves them whole (NO_FSDP). The
    counts add up to n_params()."""
    e, layers = shape.embed_dim, shape.n_layers
    attention = e * shape.head_dim * (2 * shape.n_heads + 2 * shape.n_kv_heads)
    tables = shape.vocab_size * e * (1 if shape.tie_embeddings else 2)
    n_experts = shape.n_experts
    mlp = 3 * e * shape.mlp_dim
    if n_experts:  # the shared expert (if any) is split like a dense MLP
        mlp = 3 * e * shape.expert_dim if shape.shared_expert else 0
    groups = [
        (layers * (attention + mlp), ("tensor", "pipeline")),
        (layers * shape.norms_per_block * e, ("pipeline",)),  # each block's RMSNorm scales
        (tables, ("tensor",)),  # embedding and output head: vocab over tensor
        (e, ()),  # final norm
    ]
    if shape.qkv_bias:  # [heads, head_dim] and twice [kv_heads, head_dim] per block
        biases = layers * shape.head_dim * (shape.n_heads + 2 * shape.n_kv_heads)
        groups.append((biases, ("tensor", "pipeline", NO_FSDP)))
    if shape.qk_norm:  # two [head_dim] scales per block
        groups.append((layers * 2 * shape.head_dim, ("pipeline", NO_FSDP)))
    if shape.whole_qk_norm:  # [heads, head_dim] and [kv_heads, head_dim] per block
        norms = layers * shape.head_dim * (shape.n_heads + shape.n_kv_heads)
        groups.append((norms, ("tensor", "pipeline", NO_FSDP)))
    if n_experts:  # MoE: each block's router [embed, experts], then the routed experts
        groups.append((layers * e * n_experts, ("pipeline",)))
        groups.append((experts.expert_params(shape), EXPERT_AXES))
    return groups


# Marks a group of params without an `embed` dim, which ZeRO's fsdp does not shard (no mesh
# has an axis of this name).
NO_FSDP = "no fsdp"

# The routed experts' axes: their `expert` dim over (fsdp, expert) at every ZeRO stage
# (spmd.parallel.rules), their mlp dim over tensor, their layers over pipeline.
EXPERT_AXES = ("fsdp", "expert", "tensor", "pipeline")


def shape_params(shape: ModelShape) -> int:
    """Parameter count of a shape (scalars)."""
    return sum(count for count, _ in param_groups(shape))


def llama_shape(n_params: float) -> dict[str, Any]:
    """A Llama-like shape of about `n_params` parameters, for planning a raw size: vocab
    32000, head_dim 128, embed_dim 256, 512, 768 or a multiple of 1024, n_layers = n_heads =
    n_kv_heads = embed_dim / 128 (about Llama 2's aspect ratio), mlp_dim = 8/3 x embed_dim
    rounded to a multiple of 256. The embed_dim whose count is nearest is chosen."""

    def shape(width: int) -> dict[str, Any]:
        heads = width // 128
        mlp = max(256, round(8 * width / 3 / 256) * 256)
        return dict(
            vocab_size=32000,
            embed_dim=width,
            mlp_dim=mlp,
            n_layers=heads,
            n_heads=heads,
            n_kv_heads=heads,
            head_dim=128,
            tie_embeddings=False,
        )

    def count(width: int) -> float:
        return shape_params(ModelShape(**shape(width)))

    widths = [256, 512, 768, *range(1024, 65537, 1024)]  # heads divisible by 8 from 1024 on
    best = min(widths, key=lambda w: abs(math.log(count(w) / n_params)))
    return shape(best)


# The parameter counts llama_shape spans, its smallest shape's to its largest's: a size outside
# would be planned with a shape of another size (--params 1 was planned as an 18 M model).
PARAMS_RANGE = tuple(float(shape_params(ModelShape(**llama_shape(n)))) for n in (1.0, 1e300))
