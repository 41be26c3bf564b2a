"""The textbook figures of a layout: which collectives one optimizer step needs, how many and
how many bytes, and the per-device memory of its state, to set beside what spmd.estimate.hlo reads
from the compiled step.

Units are those of spmd.estimate.hlo: bytes of each op's *result* on one device, summed over the
executions in one step (an all-reduce of the grads counts P bytes, the reduce-scatter of
ZeRO-2/3 P/N, an all-gather the gathered size). On a ring each device sends about
2(N-1)/N of an all-reduce's bytes and (N-1)/N of an all-gather's or reduce-scatter's result.

Counts are the collective calls the layout makes, one per param tensor (per layer and pass
inside the layer scan); XLA's combiner may fuse several into one op (on CPU it fuses the
all-reduces of DDP's gradients into one), so a compiled count may be lower, never its bytes.

Per param tensor, from its PartitionSpecs in the three roles of spmd.parallel.rules:
- gradient: reduce-scatter over the batch axes its grad layout splits and its param layout
  does not (ZeRO-2), or over fsdp per layer and micro-batch when the param itself is split
  (ZeRO-3, from the transpose of the per-layer all_gather); all-reduce over the remaining
  batch axes (DDP, ZeRO-1; HSDP's `data`);
- params: all-gather after the update where the optimizer state is split and the params are
  not (ZeRO-1/2); with ZeRO-3, all-gather before use: a layer's params in the forward and again
  in the backward (remat), the embedding, final norm and head once; the explicit executor's
  prefetching layer scan (`prefetching`) gathers each pass's next layer one iteration ahead,
  the last iteration's a spare: 2L + 1 layer gathers per micro-batch instead of 2L; with
  accumulation the first (layer 0's, before the loop) is the same for every micro-batch and
  XLA hoists it out of their loop: 2L accum + 1;
- tensor parallel (Megatron): per layer and micro-batch, all-reduces of one activation
  [batch, length, embed] after the attention and MLP row-parallel matmuls (forward) and at
  their column-parallel inputs (backward), plus the vocab-parallel embedding (forward) and head
  (backward); 1 more per layer when the backward replays the forward (remat: the attention
  output's, to rebuild the MLP input; the MLP output is not needed again); 3 reductions of
  [batch, length] for the vocab-parallel cross-entropy; kv heads replicated over tensor add an
  all-reduce of their gradients per layer;
- expert parallel (MoE, mesh axes that split `expert`): per MoE layer and micro-batch, an
  all-to-all of the token buffer [experts, rows, capacity, embed] to the experts' devices and
  one back (forward), and their transposes (backward); 2 more when the backward replays the
  forward (remat). `expert_all_to_all` gives the figure;
- sequence parallelism (Megatron-SP): each of those activation all-reduces becomes an
  all-gather of the whole activation plus a reduce-scatter of 1/tp of it (same bytes on the
  wire: a ring all-reduce is a reduce-scatter then an all-gather), and the norm weights, now
  applied to 1/tp of the tokens per device, get their gradients summed over tensor (an
  all-reduce of 2 per layer + the final norm);
- context parallelism (ring attention over `context`): per layer and micro-batch, cp−1
  sends of this device's key and value blocks [batch, length/cp, kv_heads, head_dim] in the
  forward (collective-permutes) and as many of their gradients in the backward (+ the
  forward's again under remat); under --cp-mode ulysses 4 all-to-alls per layer and pass
  instead (spmd.estimate.context_theory); the grads of
  the params, replicated over `context`, are averaged over it like over a batch axis;
- frozen params (a LoRA base, spmd.engine.frozen): gathered as above under ZeRO-3, never
  reduced or updated (no gradient, no optimizer state);
- scalars: the loss mean and the gradient norms (4 bytes each).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spmd.engine import frozen
from spmd.estimate import experts as experts_math
from spmd.estimate import units, volumes
from spmd.estimate.context_theory import (  # noqa: F401 (the cp rows; callers read them here)
    pipelined_ring_sends,
    ring_sends,
    ulysses,
    ulysses_all_to_alls,
)
from spmd.model_shape import ModelShape
from spmd.parallel import fp8_context, rules
from spmd.parallel.mesh import BATCH_AXES

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyProgram


def activation_bytes(program: AnyProgram) -> int:
    """Bytes per element of the program's compute dtype (activations)."""
    return np.dtype(program.policy.compute_dtype).itemsize


def expert_capacity(model: ModelShape, seq_len: int) -> int:
    """(token, choice) pairs one expert takes per sequence (spmd.estimate.experts.capacity)."""
    return experts_math.capacity(model, seq_len)


def expert_all_to_all(
    model: ModelShape,
    mesh: Any,
    global_batch: int,
    seq_len: int,
    accum: int = 1,
    *,
    element_bytes: int,
    sequence_parallel: bool = False,
    precision: str = "fp32",
) -> dict[str, int]:
    """{"count", "bytes", "bytes_per_layer", "group"} of the MoE token all-to-alls of one step
    per device ({} without experts or when no mesh axis splits them), activations of
    `element_bytes` each: the formula of spmd.estimate.volumes.all_to_all, which the planner
    uses too, for the dispatch models/moe.py runs on the layout (the sorted rows' or the
    one-hot buffer's, spmd.estimate.experts.exchange_dispatch)."""
    remat = model.remat != "none"
    sizes = dict(mesh.shape)
    exchanged = experts_math.exchange_dispatch(sizes, sequence_parallel, precision)
    return volumes.all_to_all(
        model, sizes, global_batch, seq_len, accum, remat, element_bytes, exchanged
    )


def program_all_to_all(
    program: AnyProgram, model: ModelShape, global_batch: int, seq_len: int, element_bytes: int
) -> dict[str, int]:
    """`expert_all_to_all` of a built program: its mesh, accumulation, sequence parallelism
    and precision (fp8 experts keep the one-hot dispatch)."""
    return expert_all_to_all(
        model,
        program.layout.mesh,
        global_batch,
        seq_len,
        program.accum,
        element_bytes=element_bytes,
        sequence_parallel=getattr(program.layout, "sequence_parallel", False),
        precision="fp8" if getattr(program.policy, "fp8", None) is not None else "fp32",
    )


def expert_summary(program: AnyProgram, all_to_all: dict[str, int]) -> str:
    """One line: the MoE all-to-all bytes per layer and the experts' params per device."""
    names = jax.tree.leaves(program.names, is_leaf=lambda x: isinstance(x, tuple))
    leaves = jax.tree.leaves(program.abstract_params)
    experts = [p for n, p in zip(names, leaves, strict=True) if "expert" in n]
    mesh = program.layout.mesh
    local = sum(_local_bytes(p.shape, p.dtype, p.sharding.spec, mesh) for p in experts)
    total = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in experts)
    moved = units.binary(all_to_all.get("bytes_per_layer", 0))
    return (
        f"experts: all-to-all {moved} per MoE layer per step (per device); experts' params "
        f"{units.binary(local)} per device of {units.binary(total)} (1/{total // max(local, 1)})"
    )


def pipeline_sends(
    program: AnyProgram, model: ModelShape, pipeline: dict, global_batch: int, seq_len: int
) -> dict[str, int]:
    """{"count", "bytes"} of the schedule's messages per device per step: each tick every
    stage sends one micro-batch's residual activations [rows, length, embed] forward and their
    gradient backward (a `ppermute` each way); the length is split over cp, and over tp too
    under sequence parallelism."""
    layout = program.layout
    rows = global_batch // (layout.data_parallel * pipeline["microbatches"])
    tokens = rows * seq_len / layout.mesh.shape["context"]
    activation = tokens * model.embed_dim * activation_bytes(program)
    count, sent = volumes.stage_sends(
        pipeline["ticks"],
        activation,
        layout.mesh.shape["tensor"],
        getattr(layout, "sequence_parallel", False),
    )
    return {"count": count, "bytes": round(count * sent)}


def _axes(spec: PartitionSpec) -> list[tuple[str, ...]]:
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def _local_bytes(shape: tuple[int, ...], dtype: Any, spec: PartitionSpec, mesh: Any) -> int:
    ways = [math.prod(mesh.shape[a] for a in axes) for axes in _axes(spec)]
    ways += [1] * (len(shape) - len(ways))
    return math.prod(s // w for s, w in zip(shape, ways, strict=True)) * np.dtype(dtype).itemsize


def _whole(spec: PartitionSpec, batch_axes: set[str], names: tuple = ()) -> PartitionSpec:
    """`spec` without the batch axes: a ZeRO-3 param as the compute uses it (gathered). An
    `expert` dim keeps its axes: experts stay split (the tokens travel to them instead)."""
    names = tuple(names) + (None,) * (len(spec) - len(names))
    return PartitionSpec(
        *[
            ax if name == "expert" else tuple(a for a in ax if a not in batch_axes)
            for name, ax in zip(names, _axes(spec), strict=False)
        ]
    )


def _gathered(spec: PartitionSpec, names: tuple) -> set[str]:
    """Mesh axes of `spec` on dims a layer gathers before use (all but an `expert` dim)."""
    names = tuple(names) + (None,) * (len(spec) - len(names))
    return {a for name, ax in zip(names, _axes(spec), strict=False) if name != "expert" for a in ax}


def _fp8_gathered(
    program: AnyProgram,
    names: tuple,
    shape: tuple[int, ...],
    whole: PartitionSpec,
    stored: PartitionSpec,
    mesh: Any,
) -> int:
    """Devices a stacked block matrix is gathered over when --fp8-all-gather sends it in e4m3
    (spmd.parallel.fp8_gather: a matrix whose dims, as a layer uses it, reach the fp8 size
    rule); 0 when it travels in its own dtype."""
    fp8 = getattr(program.policy, "fp8", None)
    if fp8 is None or not fp8.all_gather or not names or names[0] != "layers" or len(shape) < 3:
        return 0
    ways = [math.prod(mesh.shape[a] for a in axes) for axes in _axes(whole)]
    ways += [1] * (len(shape) - len(ways))
    used = [s // w for s, w in zip(shape, ways, strict=True)][1:]
    gathered = {a for axes in _axes(stored) for a in axes} - {a for ax in _axes(whole) for a in ax}
    devices = math.prod(mesh.shape[a] for a in gathered)
    return devices if fp8_context.reaches(fp8, *used) else 0


def _specs(tree: Any) -> list[PartitionSpec]:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    return [s.spec for s in leaves]


def collectives(
    program: AnyProgram,
    model: ModelShape,
    global_batch: int,
    seq_len: int,
    pipeline: dict | None = None,
) -> dict:
    """Per kind: {"count": calls per step, "bytes": result bytes per device per step};
    `pipeline`: the schedule's summary when pp > 1 (its ticks run the tensor-parallel
    collectives of one chunk each)."""
    mesh, zero, accum = program.layout.mesh, program.layout.zero_stage, program.accum
    names_tree, shapes_tree = program.names, program.abstract_params
    # every axis that splits the tokens averages the gradients: the batch axes and context
    batch_axes = {a for a in (*BATCH_AXES, "context") if mesh.shape.get(a, 1) > 1}
    by_role = {
        role: _specs(rules.tree_shardings(names_tree, shapes_tree, mesh, zero, role))
        for role in ("params", "grads", "opt_state")
    }
    named = jax.tree_util.tree_flatten_with_path(
        names_tree, is_leaf=lambda x: isinstance(x, tuple)
    )[0]
    names = [leaf for _, leaf in named]
    has_frozen = frozen.has_frozen(names_tree)  # a LoRA base: its top-level key
    fixed = [has_frozen and path[0].key == frozen.FROZEN for path, _ in named]
    shapes = jax.tree.leaves(shapes_tree)
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})

    def add(kind: str, count: int, nbytes: int) -> None:
        out[kind]["count"] += count
        out[kind]["bytes"] += nbytes

    element_bytes = activation_bytes(program)
    norm_groups = set()
    for i, (leaf_names, leaf) in enumerate(zip(names, shapes, strict=True)):
        param, grad, opt = (by_role[r][i] for r in ("params", "grads", "opt_state"))
        param_axes, grad_axes, opt_axes = (
            {a for axes in _axes(s) for a in axes} for s in (param, grad, opt)
        )
        # Gradients travel in the policy's reduce dtype (--grad-reduce), params in their working
        # dtype (16-bit under bf16 / fp16): the ZeRO paper's 2 + 2 bytes per param.
        grad_bytes = _local_bytes(leaf.shape, program.policy.reduce_dtype, grad, mesh)
        layers = leaf.shape[0] if leaf_names and leaf_names[0] == "layers" else 1
        zero3 = bool(_gathered(param, leaf_names) & batch_axes)
        if zero3:  # ZeRO-3: gathered before use, reduce-scattered by autodiff; it gathers what
            # autodiff differentiates: the params in the reduce dtype (a frozen one as stored)
            gather_dtype = leaf.dtype if fixed[i] else program.policy.reduce_dtype
            whole = _whole(param, batch_axes, leaf_names)
            fp8_scales = _fp8_gathered(program, leaf_names, leaf.shape, whole, param, mesh)
            gather_dtype = np.dtype(jnp.float8_e4m3fn) if fp8_scales else gather_dtype
            gathered = _local_bytes(leaf.shape, gather_dtype, whole, mesh)
            gathers = 1  # a param outside the layer stack: once
            if layers > 1:  # each layer per pass (one more with prefetching, spmd.estimate.volumes)
                gathers = volumes.param_gathers(accum, layers, False, prefetching(program, model))
            add("all-gather", gathers, gathers * gathered // layers)
            if fp8_scales:  # and one fp32 scale per device beside each e4m3 gather
                add("all-gather", gathers, gathers * 4 * fp8_scales)
        if fixed[i]:  # a frozen param: no gradient to reduce, no update to gather
            continue
        if pipeline is not None and leaf_names[:1] != ("layers",):  # every stage's: summed, fp32
            add("all-reduce", 1, _local_bytes(leaf.shape, np.dtype(np.float32), param, mesh))
        if zero3:
            add("reduce-scatter", accum * layers, accum * grad_bytes)
        elif (grad_axes - param_axes) & batch_axes:  # ZeRO-2
            add("reduce-scatter", 1, grad_bytes)
        if batch_axes - grad_axes:
            add("all-reduce", 1, grad_bytes)
        if (opt_axes - param_axes) & batch_axes:  # ZeRO-1/2: gather the updated slices
            add("all-gather", 1, _local_bytes(leaf.shape, leaf.dtype, param, mesh))
        norm_groups |= {frozenset(s) for s in (grad_axes, opt_axes) if s}
    if mesh.shape["tensor"] > 1:
        sequence_parallel = getattr(program.layout, "sequence_parallel", False)
        _tensor_parallel(
            out,
            model,
            mesh,
            zero,
            accum,
            (global_batch, seq_len, element_bytes),
            sequence_parallel,
            # a pipeline's schedule differentiates the embedding, frozen or not
            frozen_embedding=has_frozen and mesh.shape["pipeline"] == 1,
            pipeline=pipeline,
        )
    experts = program_all_to_all(program, model, global_batch, seq_len, element_bytes)
    if experts:
        add("all-to-all", experts["count"], experts["bytes"])
    if mesh.shape.get("context", 1) > 1 and ulysses(program):
        add("all-to-all", *ulysses_all_to_alls(program, model, global_batch, seq_len, pipeline))
    elif mesh.shape.get("context", 1) > 1:
        add(
            "collective-permute",
            *ring_sends(model, mesh, accum, global_batch, seq_len, element_bytes),
        )
    scalars = len(norm_groups) + bool(batch_axes)
    if scalars:
        add("all-reduce", scalars, 4 * scalars)
    return dict(out)


def _tensor_parallel(
    out: dict,
    model: ModelShape,
    mesh: Any,
    zero: int,
    accum: int,
    step: tuple[int, int, int],
    sequence_parallel: bool = False,
    frozen_embedding: bool = False,
    pipeline: dict | None = None,
) -> None:
    """Add Megatron's activation all-reduces over `tensor` (see the module docstring), or
    under sequence parallelism their all-gathers and reduce-scatters; `step`: (global batch,
    sequence length, bytes per activation element); `frozen_embedding`: a LoRA base's;
    `pipeline`: the schedule's summary, whose every tick runs one chunk of layers on one
    micro-batch (stages in lockstep: an idle slot's collectives ride the bubble)."""
    global_batch, seq_len, element_bytes = step
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    rows = global_batch // shards // accum
    passes = (accum, model.n_layers, model.remat != "none", False)
    if pipeline is not None:
        rows = global_batch // (shards * pipeline["microbatches"])
        chunk = model.n_layers // (pipeline["stages"] * pipeline["virtual"])
        passes = (pipeline["ticks"], chunk, model.remat != "none", True)
    tokens = rows * seq_len // mesh.shape.get("context", 1)
    activation = tokens * model.embed_dim * element_bytes
    tensor = mesh.shape["tensor"]
    embed = model.embed_dim // (mesh.shape["fsdp"] if zero == 3 else 1)
    norms = (model.norms_per_block * passes[1] + 1, embed * 4)  # norm weights' fp32 grads (SP)
    traffic = volumes.tensor_traffic(
        activation, tokens, norms, tensor, sequence_parallel, passes,
        frozen_embedding=frozen_embedding,
    )  # fmt: skip
    for kind, nbytes, count, _ in traffic:
        out[kind]["count"] += count
        out[kind]["bytes"] += count * nbytes
    if tensor > model.n_kv_heads:  # replicated kv heads: their grads are summed per layer
        kv_bytes = 2 * embed * model.n_kv_heads * model.head_dim * 4
        out["all-reduce"]["count"] += 2 * accum * model.n_layers
        out["all-reduce"]["bytes"] += accum * model.n_layers * kv_bytes


def prefetching(program: AnyProgram, model: ModelShape) -> bool:
    """Whether the program's ZeRO-3 layer scan prefetches (hooks.scan_layers): the explicit
    executor with --prefetch 1 and rematerialised layers. Pipelined programs keep the count of
    gathering in place: theory does not model ZeRO-3 per pipeline chunk."""
    remat = model.remat != "none"
    return bool(program.prefetch) and remat and program.layout.mesh.shape["pipeline"] == 1


def memory(program: AnyProgram, global_batch: int, seq_len: int) -> dict[str, int]:
    """Per-device bytes: the compiled step's arguments (params + optimizer state + batch, each
    leaf split the ways its layout says) and, for ZeRO-3, the largest layer gathered whole."""
    mesh = program.layout.mesh
    state = 0
    for tree in (program.abstract_params, program.abstract_opt_state):
        for leaf in jax.tree.leaves(tree):
            state += _local_bytes(leaf.shape, leaf.dtype, leaf.sharding.spec, mesh)
    batch = program.abstract_batch(global_batch, seq_len)
    for leaf in jax.tree.leaves(batch):
        state += _local_bytes(leaf.shape, leaf.dtype, leaf.sharding.spec, mesh)
    return {"argument": state, "gathered_layer": gathered_layer_bytes(program)}


def gathered_layer_bytes(program: AnyProgram) -> int:
    """Bytes of one layer's params as the compute uses them (ZeRO-3's fsdp shards gathered;
    tensor shards stay split); 0 when the params are not gathered per layer."""
    mesh = program.layout.mesh
    batch_axes = {a for a in BATCH_AXES if mesh.shape[a] > 1}
    names = jax.tree.leaves(program.names, is_leaf=lambda x: isinstance(x, tuple))
    total = 0
    for leaf_names, leaf in zip(names, jax.tree.leaves(program.abstract_params), strict=True):
        spec = leaf.sharding.spec
        split = _gathered(spec, leaf_names) & batch_axes
        if leaf_names[:1] == ("layers",) and split:
            whole = _local_bytes(leaf.shape, leaf.dtype, _whole(spec, batch_axes, leaf_names), mesh)
            total += whole // leaf.shape[0]
    return total
