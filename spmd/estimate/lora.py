"""The adapters of a planned LoRA run (models/lora.py): how many scalars one device holds.

For a target with base weight W [in, out] the adapter is A [in, r] and B [r, out], in every
stacked layer. A carries W's input logical axes and B its output axes, the rank dim none
(replicated): a dim named `embed` is sharded over fsdp by ZeRO, `heads`, `kv_heads` and `mlp`
over tensor, `layers` over pipeline (spmd.parallel.rules). So q's A [embed, r] is split over
fsdp but whole over tensor, its B [r, heads x head_dim] over tensor but whole over fsdp; o's and
down's the other way round. The frozen base is counted as the model's params (spmd.estimate.
memory); the adapters add to its params, and are all the gradients and optimizer state hold.

What a step communicates for them (`state_traffic`, `tensor_traffic`): the engine forms and
reduces the adapters' gradients only (spmd.engine.frozen), so the gradient reduction and the
ZeRO-1/2 gather of the updated params carry the adapters alone; ZeRO-3 still gathers the
frozen base's blocks for the forward and backward passes (spmd.estimate.comms), and the
adapters' `embed`-side matrices with them. Under tensor parallelism each adapter adds a
reduction of its [tokens, r] low-rank activation (models/adapter.py).
"""

from __future__ import annotations

import math
from typing import Any

from spmd.errors import UsageError
from spmd.estimate.shape import NO_FSDP
from spmd.estimate.units import si

EMBED = "embed"
# one collective in spmd.estimate.comms.Comm's fields: kind, axes, group, bytes, count,
# purpose, hideable
Traffic = tuple[str, tuple[str, ...], int, float, float, str, bool]


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


def split_per_device(s: Any) -> tuple[float, float]:
    """(scalars of the adapter matrices with an `embed` dim, which ZeRO splits over fsdp; of the
    others, whole over fsdp) one device holds after tensor and pipeline split them, before
    ZeRO does."""
    sharded = whole = 0.0
    for count, axes in adapter_groups(s.shape, s.lora_rank, s.lora_targets):
        held = count / math.prod(s.sharding_mesh.get(a, 1) for a in axes)
        if NO_FSDP in axes:
            whole += held
        else:
            sharded += held
    return sharded, whole


def state_traffic(s: Any) -> list[Traffic]:
    """(kind, axes, group, bytes, count, purpose, hideable), spmd.estimate.comms.Comm's fields,
    of the adapters' gradient reduction and, under ZeRO-1 and -2, the gather of the updated
    adapters, as spmd.estimate.comms.state_collectives reduces a full model's params: with E
    the bytes of the `embed`-side matrices one device holds after tensor and pipeline split
    them and R the others' (whole over fsdp), DDP and ZeRO-1 all-reduce E + R once per step;
    ZeRO-2 and -3 reduce-scatter E over fsdp and all-reduce R every micro-batch, then
    all-reduce E's shards over a data (expert, context) axis beside fsdp once; ZeRO-1 and -2
    all-gather the updated E. ZeRO-3's gathers of E are the blocks' (`gathered_bytes`)."""
    mesh, n, fsdp = s.mesh, s.micro_steps, s.sharded_fsdp
    sharded, whole = split_per_device(s)
    grads = s.bytes_of("grads")
    replicas = mesh["data"] * mesh.get("expert", 1) * s.context
    outer = tuple(a for a in ("data", "expert", "context") if mesh.get(a, 1) > 1)
    if fsdp == 1:
        axes = tuple(a for a in ("data", "fsdp", "expert", "context") if mesh.get(a, 1) > 1)
        group = s.data_parallel * s.context
        reduced = (sharded + whole) * grads
        return [("all-reduce", axes, group, reduced, 1, "adapter grads", True)] if group > 1 else []
    everywhere = (*outer[:1], "fsdp", *outer[1:])
    out: list[Traffic]
    if s.zero == 1:
        reduced = (sharded + whole) * grads
        out = [("all-reduce", everywhere, replicas * fsdp, reduced, 1, "adapter grads", True)]
    else:
        shard = sharded * grads / fsdp
        out = [
            ("reduce-scatter", ("fsdp",), fsdp, shard, n, "adapter grads", True),
            ("all-reduce", everywhere, replicas * fsdp, whole * grads, n, "adapter grads", True),
        ]
        if replicas > 1:
            out.append(("all-reduce", outer, replicas, shard, 1, "adapter grad shards", True))
    if s.zero == 3:
        return out
    updated = sharded * s.bytes_of("weights")
    return out + [("all-gather", ("fsdp",), fsdp, updated, 1, "updated adapters", True)]


def gathered_bytes(s: Any) -> float:
    """Bytes of the adapters ZeRO-3 gathers with their layer's base params (the `embed`-side
    matrices, whole over fsdp; the others are not split over it), once per gather of the
    blocks."""
    return split_per_device(s)[0] * s.bytes_of("weights") if s.lora_rank else 0.0


def tensor_traffic(s: Any, executions: int, layers: int) -> tuple[float, float]:
    """(bytes per call, calls per step) of the adapters' tensor-parallel all-reduces: one of
    the low-rank activation [tokens, r] (compute dtype) per target, layer and pass where it is
    a partial sum over tensor (models/adapter.py). A row-parallel target's (o, down) x A sums
    the split input dim: reduced in the forward (again when remat or a pipeline's backward
    slot replays it); a column-parallel target's (q, k, v, gate, up) gradient of x A, dy B^T,
    sums the split output dim: reduced in the backward. `executions` and `layers` are
    spmd.estimate.comms.tensor_passes'."""
    sizes = _sizes(s.shape)
    row = sum(1 for name in s.lora_targets if sizes[name][0][1] != EMBED)
    column = len(s.lora_targets) - row
    forwards = 1 + int(s.remat != "none") + int(s.pipelined)
    tokens = s.micro_batch * s.seq_len / s.context
    per_call = tokens * s.lora_rank * s.bytes_of("compute")
    return per_call, executions * layers * (row * forwards + column)


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


# B per value of a quantized base's codes (models/nf4.py FORMATS; spmd.estimate.memory adds the
# 1/16 B of fp32 scales per value)
CODE_BYTES = {"nf4": 0.5, "int8": 1.0}


def state_words(per_param: dict[str, float], adapters: float, base_dtype: str = "") -> str:
    """What a LoRA run keeps per parameter, from spmd.estimate.memory.bytes_per_param's
    `per_param` and the `adapters`' scalar count: the frozen base's params alone (no
    gradients, master weights or moments: spmd.engine.frozen; `base_dtype` nf4 or int8: its
    codes and scales, spmd.estimate.memory.frozen_base_bytes), the adapters' all of them."""
    terms = " + ".join(f"{per_param[role]:g}" for role in ("params", "grads", "optimizer"))
    code = CODE_BYTES.get(base_dtype)
    base = f"{code:g} + 0.0625 ({base_dtype} codes + scales)" if code else per_param["params"]
    return (
        f"the frozen base {base} B/param, the {si(adapters, '').strip()} adapter "
        f"params {terms} = {sum(per_param.values()):g} B/param"
    )
