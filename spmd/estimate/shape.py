"""Where a model's parameters live, as the planner sees it, and the published shape that stands
for a bare parameter count (`--params 8e9`: Llama 3.1 8B's).

Pure arithmetic, no JAX. The model is a spmd.model_shape.ModelShape (its family builds it);
counts are parameters (scalars).
"""

from __future__ import annotations

import dataclasses
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
    (NO_FSDP). The counts add up to the shape's n_params() and its BUFFERS."""
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
    "router_bias": ("pipeline", NO_FSDP),  # [layers, experts]: whole but for the layers
    "sinks": ("tensor", "pipeline", NO_FSDP),  # [heads], split with the heads
    "o_bias": ("pipeline",),  # [embed], as a norm's scale
    "router_logit_bias": ("pipeline", NO_FSDP),  # [experts], whole
    "expert_bias": EXPERT_AXES,  # [experts, 2 x mlp]: as the experts' matrices
    "expert_out_bias": ("fsdp", "expert", "pipeline"),  # [experts, embed]: the embed whole
}


def shape_params(shape: ModelShape) -> int:
    """Parameter count of a shape (scalars)."""
    return shape.n_params()


@dataclasses.dataclass(frozen=True)
class Release:
    """A published decoder's shape (its Hugging Face config.json), as llama-family fields."""

    name: str  # the release, e.g. "Llama 3.1 8B"
    vocab_size: int
    embed_dim: int  # hidden_size
    mlp_dim: int  # intermediate_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int
    tie_embeddings: bool = False  # tie_word_embeddings
    qk_norm: bool = False  # Qwen3's per-head q and k norms

    def fields(self) -> dict[str, Any]:
        """The llama-family config fields of the shape (FIELDS, and qk_norm)."""
        out = {f: getattr(self, f) for f in FIELDS}
        return out | {"qk_norm": True} if self.qk_norm else out

    def n_params(self) -> int:
        """Its parameter count (scalars)."""
        return shape_params(ModelShape(**self.fields()))


# The shapes `--params` plans with: current dense releases, one per size, from their published
# config.json files (Meta's Llama 3.1 / 3.2, Qwen's Qwen3 and Mistral's Large 2, where Llama
# has no size: below 1 B, between 8 B and 70 B, between 70 B and 405 B). GQA with 8 kv heads
# throughout, a 128 k or 152 k vocabulary, the small ones with tied embeddings.
RELEASES = (
    Release("Qwen3-0.6B", 151936, 1024, 3072, 28, 16, 8, 128, True, True),
    Release("Llama 3.2 1B", 128256, 2048, 8192, 16, 32, 8, 64, True),
    Release("Llama 3.2 3B", 128256, 3072, 8192, 28, 24, 8, 128, True),
    Release("Llama 3.1 8B", 128256, 4096, 14336, 32, 32, 8, 128),
    Release("Qwen3-14B", 151936, 5120, 17408, 40, 40, 8, 128, qk_norm=True),
    Release("Qwen3-32B", 151936, 5120, 25600, 64, 64, 8, 128, qk_norm=True),
    Release("Llama 3.1 70B", 128256, 8192, 28672, 80, 64, 8, 128),
    Release("Mistral Large 2 (123B)", 32768, 12288, 28672, 88, 96, 8, 128),
    Release("Llama 3.1 405B", 128256, 16384, 53248, 126, 128, 8, 128),
)


def release_for(n_params: float) -> Release:
    """The release of RELEASES whose parameter count is nearest `n_params` (by ratio)."""
    return min(RELEASES, key=lambda r: abs(math.log(r.n_params() / n_params)))


# The sizes --params plans: within a factor of 2 of the smallest and largest release (the
# releases lie less than a factor of 3.4 apart, so every size in between is within 1.9 of
# one). Further out the shape would be another model's (--params 1 was once planned as 18 M).
PARAMS_RANGE = (RELEASES[0].n_params() / 2, RELEASES[-1].n_params() * 2)
