"""The arithmetic of an MoE layer's experts, shared by the planner (spmd.estimate.cost, .shape,
.timing) and the compiled-step figures (spmd.estimate.theory): one source of each formula (the
token all-to-all's volume is spmd.estimate.volumes').

Pure arithmetic, no JAX. `model` is a spmd.model_shape.ModelShape (n_experts 0: dense).
Counts are parameters or elements, FLOPs per token.
"""

from __future__ import annotations

import math

from spmd.model_shape import ModelShape, moe_grouped_rows, moe_peer_block_rows


def capacity(model: ModelShape, seq_len: int) -> int:
    """(token, choice) pairs one expert takes per sequence: the sequence length when dropless,
    else ceil(capacity_factor x seq_len x k / E), at most seq_len."""
    if model.capacity_factor <= 0:
        return seq_len
    wanted = model.capacity_factor * seq_len * model.experts_per_token / model.n_experts
    return min(seq_len, math.ceil(wanted))


def expert_params(model: ModelShape) -> int:
    """Parameters of all routed experts of all layers (three SwiGLU matrices each)."""
    return model.param_counts().get("experts", 0)


def active_params(model: ModelShape, n_params: int) -> int:
    """Parameters one token uses of a model of `n_params`: all but the E - k routed experts it
    skips in every layer."""
    return n_params - (model.n_params() - model.n_active_params())


def exchange_dispatch(
    mesh: dict[str, int], sequence_parallel: bool = False, precision: str = "fp32"
) -> bool:
    """Whether models/moe.py sends the sorted rows to their experts by all-to-all
    (models/moe_all_to_all.py): the experts are split over devices (ep or fsdp > 1 in the mesh
    the state is sharded on) and neither sequence parallelism with tp > 1, fp8 experts, a
    pipeline nor context parallelism keeps the one-hot dispatch
    (spmd.parallel.expert_exchange.exchange_blocked)."""
    split = mesh.get("expert", 1) * mesh.get("fsdp", 1) > 1
    return (
        split
        and _sortable(mesh, sequence_parallel, precision)
        and not (mesh.get("pipeline", 1) > 1 or mesh.get("context", 1) > 1)
    )


def _sortable(mesh: dict[str, int], sequence_parallel: bool, precision: str) -> bool:
    return not ((sequence_parallel and mesh.get("tensor", 1) > 1) or precision == "fp8")


def sorted_dispatch(
    mesh: dict[str, int], sequence_parallel: bool = False, precision: str = "fp32"
) -> bool:
    """Whether models/moe.py runs the sort-based dispatch on this layout, on each device's
    whole experts or by all-to-all to split ones (`exchange_dispatch`); elsewhere (sequence
    parallelism with tp > 1, fp8 experts, experts split under a pipeline or context
    parallelism) the one-hot einsum dispatch."""
    split = mesh.get("expert", 1) * mesh.get("fsdp", 1) > 1
    if split:
        return exchange_dispatch(mesh, sequence_parallel, precision)
    return _sortable(mesh, sequence_parallel, precision)


def exchange_rows(model: ModelShape, seq_len: int, sequences: int, ways: int) -> tuple[int, int]:
    """(rows of each peer block, rows the device's grouped matmul runs) of the padded
    all-to-all of the sorted rows, for `sequences` sequences per device and experts split
    `ways` ways (spmd.model_shape.moe_peer_block_rows, moe_grouped_rows)."""
    local = model.n_experts // ways
    k, cap = model.experts_per_token, capacity(model, seq_len)
    block = moe_peer_block_rows(sequences, seq_len, k, local, cap)
    return block, moe_grouped_rows(ways * block, local)


def dispatch_slots(
    model: ModelShape, seq_len: int, sorted_rows: bool, exchange: tuple[int, int] | None = None
) -> float:
    """Expert rows run per token: the sorted dispatch's routed rows with the CPU grouped
    matmul's block padding (spmd.model_shape.moe_grouped_rows; GPU / TPU's ragged_dot runs
    k, so this overcounts there by at most that padding), or the one-hot dispatch's every
    capacity slot of every expert (E x capacity / seq_len). `exchange` (sequences per device
    per micro-batch, ways the experts are split) where the sorted rows travel by all-to-all:
    each device runs the grouped matmul over every row of the padded blocks it receives
    (`exchange_rows`), per token of its own."""
    if sorted_rows and exchange is not None:
        sequences, ways = exchange
        return exchange_rows(model, seq_len, sequences, ways)[1] / (sequences * seq_len)
    if sorted_rows:
        return moe_grouped_rows(seq_len * model.experts_per_token, model.n_experts) / seq_len
    return model.n_experts * capacity(model, seq_len) / seq_len


def exchange_of(
    mesh: dict[str, int], sequences: int, sequence_parallel: bool, precision: str
) -> tuple[int, int] | None:
    """`dispatch_slots`' exchange argument for a layout: (sequences per device per
    micro-batch, ways the experts are split) where `exchange_dispatch` runs, else None."""
    if not exchange_dispatch(mesh, sequence_parallel, precision):
        return None
    return sequences, mesh.get("expert", 1) * mesh.get("fsdp", 1)


def padding_flops_per_token(
    model: ModelShape,
    seq_len: int,
    sorted_rows: bool = False,
    exchange: tuple[int, int] | None = None,
) -> tuple[float, float]:
    """(forward, backward) FLOPs per token and layer that an MoE layer executes beyond its
    active params. Sorted dispatch (`sorted_rows`): the CPU grouped matmul's padding rows
    (`dispatch_slots`; `exchange` as there), backward twice the forward. One-hot dispatch:
    each expert runs all `capacity` slots of every sequence, used or not (E x capacity /
    seq_len slots per token instead of k: in dropless mode E / k times the active experts'
    work; backward twice the forward), and the one-hot dispatch and combine einsums, 2 x E x
    capacity x embed each forward; backward, the dispatch's gradient flows to the tokens only
    (its one-hots carry none), the combine's to both operands (its weights are the router's).
    (0, 0) without experts."""
    n = model.n_experts
    if not n:
        return 0.0, 0.0
    width, e = model.expert_dim, model.embed_dim
    slots = dispatch_slots(model, seq_len, sorted_rows, exchange)
    if sorted_rows:
        padding = 6 * e * width * (slots - model.experts_per_token)
        return padding, 2 * padding
    experts = 6 * e * width * (slots - model.experts_per_token)
    einsum = 2 * n * capacity(model, seq_len) * e
    return experts + 2 * einsum, 2 * experts + 3 * einsum
