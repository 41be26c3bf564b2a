"""Where a model's parameters live, as the planner sees it, and a Llama-like shape for a bare
parameter count (`--params 7e9`).

Pure arithmetic, no JAX. The model is a spmd.model_shape.ModelShape (its family builds it);
counts are parameters (scalars).
"""

from __future__ import annotations

import math
from typing import Any

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
    """(parameter count, mesh axes other than ZeRO's fsdp that split it) for each kind of param
    (ModelShape.param_counts), following spmd.parallel.rules: matrices split over tensor,
    stacked layers over pipeline. Every param has an `embed` dim, which ZeRO shards over fsdp,
    except an MoE's routed experts (EXPERT_AXES: split over expert and fsdp at ZeRO 1-3). The
    embedding and head stay whole over pipeline (spmd.parallel.pipeline keeps them on every
    stage). The q, k, v biases and q, k norms have no `embed` dim: ZeRO leaves them whole
    (NO_FSDP). The counts add up to the shape's n_params()."""
    return [(count, PARAM_AXES[kind]) for kind, count in shape.param_counts().items()]


# Marks a group of params without an `embed` dim, which ZeRO's fsdp does not shard (no mesh
# has an axis of this name).
NO_FSDP = "no fsdp"

# The routed experts' axes: their `expert` dim over (fsdp, expert) at every ZeRO stage
# (spmd.parallel.rules), their mlp dim over tensor, their layers over pipeline.
EXPERT_AXES = ("fsdp", "expert", "tensor", "pipeline")

# The mesh axes (besides fsdp) that split each kind of param of ModelShape.param_counts.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "matrices": ("tensor", "pipeline"),
    "norms": ("pipeline",),  # each block's RMSNorm scales
    "tables": ("tensor",),  # embedding and output head: vocab over tensor
    "final_norm": (),
    "qkv_bias": ("tensor", "pipeline", NO_FSDP),
    "qk_norm": ("pipeline", NO_FSDP),
    "whole_qk_norm": ("tensor", "pipeline", NO_FSDP),
    "router": ("pipeline",),
    "experts": EXPERT_AXES,
}


def shape_params(shape: ModelShape) -> int:
    """Parameter count of a shape (scalars)."""
    return shape.n_params()


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
