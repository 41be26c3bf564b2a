"""Muon (optax.contrib.muon, Jordan et al. 2024; Moonlight, Liu et al. 2025) on the hidden
matrices, AdamW on every other param: the split Moonlight and torchtitan use.

A hidden matrix is a param with an `embed` dim and at least one more dim besides the stacked
`layers` and MoE `expert` dims, which are batch dims (each layer's, each expert's matrix is
orthogonalised alone); the embedding and the head (a `vocab` dim), norms and biases (one dim)
and an MoE's router go to AdamW. Muon's matrix is `embed` by the param's other dims together
(wq [layers, embed, heads, head_dim] is embed x heads*head_dim per layer), so the update does
not depend on how heads are laid out. With --muon-rms r each matrix's update is scaled by
r x sqrt(max(m, n)), Moonlight's rule that gives it AdamW's update RMS, so AdamW's LR, weight
decay and schedule carry over. State: one fp32 momentum per matrix param, AdamW's two moments
per other param.

The orthogonalisation reads the whole matrix, so Muon is not elementwise: under the auto
executor the update runs on the global arrays (XLA gathers what it needs); the explicit
executor, which updates each device's slice of an elementwise rule, gathers Muon's gradients,
state and params whole for the update and keeps its slice (spmd.engine.explicit.whole_update).
Both equal one device to fp32 rounding."""

from __future__ import annotations

from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from spmd.engine.optim import Optimizer, adamw
from spmd.model_shape import ModelShape
from spmd.sections import OptimizerConfig

BATCH_DIMS = ("layers", "expert")  # stacked dims: one matrix per index
ADAMW_ONLY = "router"  # a path key whose params stay on AdamW though 2-D (MoE routers)


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple)


def dimension_numbers(path: tuple, names: tuple) -> MuonDimensionNumbers | None:
    """The MuonDimensionNumbers of a param with logical axis `names` at tree `path`: `embed`
    on one side, the other non-batch dims on the other (the reduction side is the one that
    comes first, the matmul's input); None for a param that AdamW updates."""
    keys = {getattr(key, "key", None) for key in path}
    matrix = [i for i, name in enumerate(names) if name not in BATCH_DIMS]
    if ADAMW_ONLY in keys or "vocab" in names or "embed" not in names or len(matrix) < 2:
        return None
    embed = names.index("embed")
    rest = tuple(i for i in matrix if i != embed)
    if embed < rest[0]:
        return MuonDimensionNumbers(reduction_axis=(embed,), output_axis=rest)
    return MuonDimensionNumbers(reduction_axis=rest, output_axis=(embed,))


def split(names_tree: Any) -> Any:
    """Each param's MuonDimensionNumbers, or None where AdamW updates it."""
    return jax.tree_util.tree_map_with_path(dimension_numbers, names_tree, is_leaf=_is_names)


def muon(cfg: OptimizerConfig, lr: optax.Schedule, names_tree: Any) -> optax.GradientTransformation:
    """optax.contrib.muon on the hidden matrices (`split`), spmd's AdamW (optim.adamw: masked
    decoupled decay, --beta1 / --beta2) on the rest, both on the run's LR schedule. (optax's
    Muon has an Adam of its own for the rest, Nesterov's and decaying every param; spmd's is
    --optimizer adamw's.)"""
    dims = split(names_tree)
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims, is_leaf=_is_dims)
    orthogonalised = optax.contrib.muon(
        lr,
        ns_steps=cfg.muon_ns_steps,
        beta=cfg.muon_momentum,
        weight_decay=cfg.weight_decay,
        # the whole tree's numbers: optax.partition hands this part the AdamW params masked
        # out (empty subtrees), where the numbers hold None
        muon_weight_dimension_numbers=dims,
        consistent_rms=cfg.muon_rms or None,
    )
    return optax.partition({"muon": orthogonalised, "adamw": adamw(cfg, lr, names_tree)}, labels)


def _is_dims(x: Any) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def describe(names_tree: Any, shapes: Any) -> str:
    """The split, for the run's log: how many params (scalars) and arrays each rule updates.
    `shapes` holds each param's shape (arrays or ShapeDtypeStructs)."""
    dims = jax.tree.leaves(split(names_tree), is_leaf=_is_dims)
    sizes = [leaf.size for leaf in jax.tree.leaves(shapes)]
    on_muon = sum(size for d, size in zip(dims, sizes, strict=True) if d is not None)
    arrays = sum(d is not None for d in dims)
    total = sum(sizes)
    return (
        f"optimizer: muon on {on_muon:,} params ({arrays} stacked hidden matrices, each "
        f"layer's orthogonalised apart), adamw on {total - on_muon:,} in {len(dims) - arrays} "
        f"other arrays (embeddings, head, norms, biases, routers)"
    )


def hidden_matrices(shape: ModelShape) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of the matrices `split` gives Muon in a model of `shape`, each
    layer's and each expert's apart: per block wq, wk, wv, wo and the dense MLP's (or the
    shared expert's) gate, up and down, and an MoE's routed experts' three each."""
    e, layers, heads = shape.embed_dim, shape.n_layers, shape.head_dim * shape.n_heads
    kv = shape.head_dim * shape.n_kv_heads
    mlp = shape.shared_dim if shape.n_experts else shape.mlp_dim
    out = [(layers, e, heads), (2 * layers, e, kv), (layers, heads, e)]
    if mlp:
        out.append((3 * layers, e, mlp))
    if shape.n_experts:
        out.append((3 * layers * shape.n_experts, e, shape.expert_dim))
    return out


def newton_schulz_flops(shape: ModelShape, ns_steps: int = OptimizerConfig.muon_ns_steps) -> float:
    """FLOPs of one Muon update's orthogonalisations in a model of `shape`: optax's iteration
    X <- a X + (b A + c A^2) X with A = X X^T, on each m x n matrix with m <= n (optax
    transposes the taller ones), is 2m^2n + 2m^3 + 2m^2n FLOPs, ns_steps times. Independent of
    the batch; the 1b preset's compiled step has exactly these dots beside AdamW's."""
    total = 0.0
    for count, rows, cols in hidden_matrices(shape):
        m, n = min(rows, cols), max(rows, cols)
        total += count * ns_steps * (4 * m * m * n + 2 * m**3)
    return total


MUON = Optimizer(
    name="muon",
    make=muon,
    state_slots=2,  # AdamW's two moments on the params Muon leaves to it
    matrix_state_slots=1,  # Muon's one momentum on the hidden matrices
    elementwise=False,
    fields=("muon_momentum", "muon_ns_steps", "muon_rms"),
    update_flops=newton_schulz_flops,
)
