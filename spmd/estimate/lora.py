"""The adapters of a planned LoRA run (models/lora.py): how many scalars one device holds.

For a target with base weight W [in, out] the adapter is A [in, r] and B [r, out], in every
stacked layer. A carries W's input logical axes and B its output axes, the rank dim none
(replicated): a dim named `embed` is sharded over fsdp by ZeRO, `heads`, `kv_heads` and `mlp`
over tensor, `layers` over pipeline (spmd.parallel.rules). So q's A [embed, r] is split over
fsdp but whole over tensor, its B [r, heads x head_dim] over tensor but whole over fsdp; o's and
down's the other way round. The frozen base is counted as the model's params (spmd.estimate.
memory); the adapters add to its params, and are all the gradients and optimizer state hold.
"""

from __future__ import annotations

import math
from typing import Any

from spmd.errors import UsageError
from spmd.estimate.shape import NO_FSDP

EMBED = "embed"


def _sizes(shape: Any) -> dict[str, tuple[tuple[int, str], tuple[int, str]]]:
    """Target name -> ((input size, its mesh axis kind), (output size, its kind)) of a
    Llama-shaped block: EMBED (fsdp) or "tensor"."""
    e, d = shape.embed_dim, shape.head_dim
    q, kv, m = shape.n_heads * d, shape.n_kv_heads * d, shape.mlp_dim
    return {
        "q": ((e, EMBED), (q, "tensor")),
        "k": ((e, EMBED), (kv, "tensor")),
        "v": ((e, EMBED), (kv, "tensor")),
        "o": ((q, "tensor"), (e, EMBED)),
        "gate": ((e, EMBED), (m, "tensor")),
        "up": ((e, EMBED), (m, "tensor")),
        "down": ((m, "tensor"), (e, EMBED)),
    }


def adapter_groups(shape: Any, rank: int, targets: tuple[str, ...]) -> list[tuple[int, tuple]]:
    """(scalars, the mesh axes other than ZeRO's fsdp that split them) of every A and B, in the
    form of spmd.estimate.shape.param_groups; UsageError for a target the planner cannot size."""
    sizes = _sizes(shape)
    groups = []
    for name in targets:
        if name not in sizes:
            raise UsageError(
                f"--lora-targets {name!r}: spmd.plan sizes the adapters of "
                f"{', '.join(sizes)} only; spmd.train --dry-run gives the compiled figures"
            )
        for size, kind in sizes[name]:
            axes = ("pipeline",) if kind == EMBED else ("tensor", "pipeline", NO_FSDP)
            groups.append((shape.n_layers * size * rank, axes))
    return groups


def adapters_per_device(s: Any, fsdp_shards: bool) -> float:
    """Adapter scalars one device holds under Setup `s`; `fsdp_shards`: the role is sharded
    over fsdp (its `embed` dims split)."""
    if not s.lora_rank:
        return 0.0
    fsdp = s.sharded_fsdp if fsdp_shards else 1
    return sum(
        count / math.prod(s.sharding_mesh.get(a, 1) for a in axes) / (fsdp ** (NO_FSDP not in axes))
        for count, axes in adapter_groups(s.shape, s.lora_rank, s.lora_targets)
    )


def adapter_params(s: Any) -> float:
    """Adapter scalars in all (the trainable params of the run)."""
    return sum(count for count, _ in adapter_groups(s.shape, s.lora_rank, s.lora_targets))


def tensor_replicated_flops(s: Any) -> float:
    """Forward FLOPs per token of the adapter matmuls that every tensor-parallel device runs
    whole (models/adapter.py): x A of a column-parallel target (A and x whole over tensor) and
    (x A) B of a row-parallel one (B whole, x A a partial sum): the halves whose `embed` side
    tensor parallelism leaves unsplit."""
    sizes = _sizes(s.shape)
    return sum(
        2 * s.shape.n_layers * s.lora_rank * size
        for name in s.lora_targets
        for size, kind in sizes[name]
        if kind == EMBED
    )
