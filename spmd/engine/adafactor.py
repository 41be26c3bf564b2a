"""Adafactor (optax.adafactor, Shazeer & Stern 2018) on each matrix apart: each stacked
layer's (each expert's) matrix is its own param, as Muon's are (spmd.engine.muon).

optax's Adafactor keeps, for a matrix whose two sides are both at least min_dim_size_to_factor
(--adafactor-min-dim, optax's 128), a running mean of the squared gradient per row and per
column (m + n values for an m x n matrix) instead of one per element, and the full second
moment for vectors and smaller matrices; it clips each param's update to RMS 1 and scales it
by the param's RMS (so --lr is a relative step). A stacked param [layers, embed, ...] would be
one 3-D array to optax (factored over its two largest dims, one RMS for all its layers), so
this module vmaps optax's update over the `layers` and `expert` dims: each layer's matrix gets
its own row and column means, clipping and scale, exactly optax's on that matrix alone. The
matrix is `embed` by the param's other dims together (wq [layers, embed, heads, head_dim] is
embed x heads*head_dim per layer, Muon's view), so the factoring does not depend on how heads
are laid out; a param without `embed` is its first dim by the rest.

Weight decay is decoupled as AdamW's: lr x --weight-decay x the param per step, on matrices
only (`decay_mask`); optax's own rate is absolute, so it gets that product as its schedule.

Not elementwise: the row and column means read the whole matrix, and so do the clipping and
the param scale. Under the auto executor the update runs on the global arrays; the explicit
executor gathers gradients, state and params whole for it (spmd.engine.explicit.whole_update,
`elementwise=False`). The factored means are not param-shaped, so they stay replicated
(spmd.engine.state_layout); the full second moments of the rest are sharded as AdamW's."""

from __future__ import annotations

import math
from typing import Any

import jax
import optax

from spmd.engine.optim import Optimizer, decay_mask
from spmd.model_shape import BUFFERS
from spmd.sections import OptimizerConfig

BATCH_DIMS = ("layers", "expert")  # stacked dims: one matrix per index (muon.BATCH_DIMS)


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple)


class View:
    """How one param is seen by optax: the dims vmapped over (`batch`, in order, each index
    counted after the ones before it are removed), the transpose and the rows of its matrix
    (None for a vector), and whether that matrix is factored."""

    def __init__(self, names: tuple, shape: tuple, min_dim: int) -> None:
        self.batch: list[int] = []
        inner = list(names)
        for name in BATCH_DIMS:
            if name in inner:
                self.batch.append(inner.index(name))
                inner.remove(name)
        sizes = [n for i, n in enumerate(shape) if names[i] not in BATCH_DIMS]
        self.order: tuple[int, ...] | None = None
        self.rows = 0
        if len(inner) >= 2:
            embed = inner.index("embed") if "embed" in inner else 0
            rest = [i for i in range(len(inner)) if i != embed]
            self.order = (embed, *rest) if embed < rest[0] else (*rest, embed)
            self.rows = sizes[embed] if embed < rest[0] else math.prod(sizes) // sizes[embed]
        cols = math.prod(sizes) // self.rows if self.rows else 0
        self.factored = self.order is not None and min(self.rows, cols) >= min_dim

    @property
    def label(self) -> str:
        return f"{len(self.batch)}{'f' if self.factored else 'u'}"


def views(names_tree: Any, shapes: Any, min_dim: int) -> Any:
    """Each param's View (a tree of them, `names_tree`'s structure)."""
    return jax.tree.map(
        lambda names, shape: View(names, tuple(shape.shape), min_dim),
        names_tree,
        shapes,
        is_leaf=_is_names,
    )


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _as_matrices(
    inner: optax.GradientTransformation, tree_views: Any
) -> optax.GradientTransformation:
    """`inner` on each (unstacked) factored param reshaped to its 2-D matrix, the updates
    reshaped back; the others as they are (their update is elementwise but for the RMS of the
    whole param, which a reshape does not change, and their full moment keeps their shape, so
    ZeRO shards it as AdamW's)."""

    def to_matrix(view: View, x: Any) -> Any:
        if _masked(x) or not view.factored:
            return x
        matrix = x.transpose(view.order)
        return matrix.reshape(view.rows, -1)

    def from_matrix(view: View, u: Any, p: Any) -> Any:
        if _masked(u) or view.order is None or not view.factored:
            return u
        order = view.order
        stacked = u.reshape([p.shape[i] for i in order])
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return stacked.transpose(inverse)

    def matrices(tree: Any) -> Any:
        return jax.tree.map(to_matrix, tree_views, tree, is_leaf=lambda v: isinstance(v, View))

    def init(params: Any) -> Any:
        return inner.init(matrices(params))

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, state = inner.update(matrices(grads), state, matrices(params))
        return jax.tree.map(
            from_matrix, tree_views, updates, params, is_leaf=lambda v: isinstance(v, View)
        ), state

    return optax.GradientTransformation(init, update)


def _vmapped(inner: optax.GradientTransformation, axes: Any) -> optax.GradientTransformation:
    """`inner` vmapped over one dim of each param (`axes`, a tree of ints over the params): a
    param's state leaves carry that dim first, its scalars (step counts) stay scalars."""

    def unstacked(params: Any) -> Any:
        def drop(axis: int, p: Any) -> Any:
            if _masked(p):
                return p
            shape = p.shape[:axis] + p.shape[axis + 1 :]
            return jax.ShapeDtypeStruct(shape, p.dtype)

        return jax.tree.map(drop, axes, params, is_leaf=_masked)

    def state_axes(params: Any) -> Any:
        shapes = jax.eval_shape(inner.init, unstacked(params))
        return jax.tree.map(lambda s: None if s.ndim == 0 else 0, shapes)

    def init(params: Any) -> Any:
        return jax.vmap(inner.init, in_axes=(axes,), out_axes=state_axes(params))(params)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        held = state_axes(params)
        mapped = jax.vmap(inner.update, in_axes=(axes, held, axes), out_axes=(axes, held))
        return mapped(grads, state, params)

    return optax.GradientTransformation(init, update)


def per_matrix(
    inner: optax.GradientTransformation, tree_views: Any, depth: int
) -> optax.GradientTransformation:
    """`inner` (optax's Adafactor) on each matrix of the params whose Views have `depth`
    stacked dims: reshaped to matrices, then vmapped over the stacked dims, outermost first."""
    tx = _as_matrices(inner, tree_views)
    for level in reversed(range(depth)):
        axes = jax.tree.map(
            lambda v, lv=level: v.batch[lv] if len(v.batch) == depth else 0,
            tree_views,
            is_leaf=lambda v: isinstance(v, View),
        )
        tx = _vmapped(tx, axes)
    return tx


def adafactor(
    cfg: OptimizerConfig, lr: optax.Schedule, names_tree: Any
) -> optax.GradientTransformation:
    """optax.adafactor on the run's schedule (its relative step, optax's clipping at RMS 1 and
    decay rate 0.8), factored where both sides of a matrix reach --adafactor-min-dim, each
    stacked matrix apart; decoupled weight decay lr x --weight-decay on matrices only. The
    params' shapes are read at init (a param's View needs them)."""

    def base(factored: bool) -> optax.GradientTransformation:
        return optax.adafactor(
            lr,
            min_dim_size_to_factor=cfg.adafactor_min_dim,
            factored=factored,
            weight_decay_rate=lambda count: cfg.weight_decay * lr(count),
            weight_decay_mask=decay_mask(names_tree),
        )

    def build(params: Any) -> optax.GradientTransformation:
        tree_views = views(names_tree, params, cfg.adafactor_min_dim)
        labels = jax.tree.map(lambda v: v.label, tree_views, is_leaf=lambda v: isinstance(v, View))
        groups = {
            label: per_matrix(base(label.endswith("f")), tree_views, int(label[:-1]))
            for label in sorted(set(jax.tree.leaves(labels)))
        }
        return optax.partition(groups, labels)

    def init(params: Any) -> Any:
        return build(params).init(params)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return build(params).update(grads, state, params)

    return optax.GradientTransformation(init, update)


def matrices(shape: Any) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of every 2-D matrix a model of `shape` (spmd.model_shape.ModelShape)
    trains, each layer's and each expert's apart: per block wq, wk, wv, wo, the dense MLP's
    (or the shared expert's) gate, up and down, an MoE's router and routed experts, and the
    embedding and head tables. The rest of ModelShape.param_counts are vectors (and small
    [heads, head_dim] biases and norms, counted as unfactored)."""
    e, layers, sparse = shape.embed_dim, shape.n_layers, shape.sparse_layers
    heads, kv = shape.head_dim * shape.n_heads, shape.head_dim * shape.n_kv_heads
    out = [(layers, e, heads), (2 * layers, e, kv), (layers, heads, e)]
    out.append((3 * (layers - sparse), e, shape.mlp_dim))
    if shape.n_experts:
        out.append((3 * sparse, e, shape.shared_dim))
        out.append((sparse, e, shape.n_experts))
        out.append((3 * sparse * shape.n_experts, e, shape.expert_dim))
    out.append((1 if shape.tie_embeddings else 2, shape.vocab_size, e))
    return [m for m in out if m[0] and m[1] and m[2]]


def state_values(setup: Any) -> float:
    """Values of Adafactor state per trained param of the planner's `setup`
    (spmd.estimate.cost.Setup): m + n per factored m x n matrix (both sides >= its
    adafactor_min_dim), one per element elsewhere. Left out: optax's size-1 placeholders (one
    or two values per matrix or vector) and its step counts. Under LoRA every adapter is
    counted whole (1 per param): exact while the rank is below the minimum side."""
    if setup.lora_rank:
        return 1.0
    shape = setup.shape
    counts = shape.param_counts()
    trained = sum(n for kind, n in counts.items() if kind not in BUFFERS)
    values = float(trained)
    for count, rows, cols in matrices(shape):
        if min(rows, cols) >= setup.adafactor_min_dim:
            values -= count * (rows * cols - rows - cols)
    return values / trained


ADAFACTOR = Optimizer(
    name="adafactor",
    make=adafactor,
    state_slots=1,  # the full second moment where a param is not factored
    elementwise=False,
    fields=("adafactor_min_dim",),
    state_values=state_values,
)
