"""How a model's stacked layers run: one `lax.scan` over the `layers` dim under a remat policy,
and under ZeRO-3 (explicit executor) with prefetch: the next layer's params are all-gathered
while the current layer computes, in the forward and in the backward pass (double buffering).

The remat policy never saves a param gathered for use (tagged GATHERED by hooks.gather) nor a
value that only re-lays one out: the backward pass gathers again instead, so without prefetch
one layer is whole at a time (ZeRO-3's memory).

Without prefetch (`hooks.gather` inside each layer) layer i's all_gather is issued in iteration
i, right before the matmuls that need it, so its time is exposed unless XLA's collective
pipeliner moves it. Here the scan carries layer i's gathered params into iteration i, whose
first op is the all_gather of the next layer's shards; nothing in iteration i waits for it, so
a latency-hiding scheduler (the GPU preset, spmd.parallel.xla_flags) runs it beside layer i's
compute.

Autodiff cannot write this backward pass: differentiating a scan whose carry holds gathered
params saves every layer's gathered params (the whole model) as residuals. So the scan is a
`custom_vjp`:
- forward: each layer runs as `jax.vjp` of the layer under the layout's remat policy, and its
  residuals are kept except its gathered params. Those are found by identity among the
  residual leaves: the policy never saves a re-layout of them (a cast, reshape, broadcast), so
  a gathered param is a residual, if at all, as itself. The last iteration's prefetch gathers
  the last layer again, which the backward pass starts with;
- backward: layers in reverse, each one's params gathered one iteration ahead, its residuals
  completed with them, its vjp applied, and the gathered params' cotangent reduce-scattered
  back to shards (the transpose of the all_gather, as autodiff would write it).

Both passes are one loop over every layer (no layer is peeled off: a layer outside the loop
would keep temporaries of its own). Per micro-batch that is L + 1 layer all-gathers forward
and L backward (the last of each a spare: 2L without prefetch); up to three layers' params
are whole at once (computing, prefetching, and the forward's last kept for the backward).

Used only when the layers are rematerialised (hooks.scan_layers): with none, `jax.vjp`'s
residuals per layer are more than XLA's own scan keeps (a loop-invariant mask and one more
attention-sized tensor per layer, measured), so prefetch would cost activation memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

Arrays = list[jax.Array]

# checkpoint_name of a param gathered for use; the layer remat policy never saves it.
GATHERED = "spmd_gathered_param"

# Ops that only re-lay out their input: free to recompute, and saving one that reads a gathered
# param (e.g. a norm scale broadcast to the activations' rank) would keep that param whole.
_LAYOUT_OPS = ("broadcast_in_dim", "reshape", "transpose", "convert_element_type", "squeeze")


def tag_gathered(value: jax.Array) -> jax.Array:
    """Mark a param gathered for use, so that no remat policy of remat_policy's saves it."""
    return checkpoint_name(value, GATHERED)


def _not_saved(primitive: Any, params: dict, axes: frozenset[str]) -> bool:
    """Whether the remat policy of a layer whose params are gathered over `axes` must not
    save this op's output: a gathered param, a param all-gathered over `axes`, a re-layout.
    An all_gather over other axes (sequence parallelism's activations over `tensor`, context
    parallelism's keys and values) is an activation, saved as the policy says."""
    if primitive.name == "name":
        return params.get("name") == GATHERED
    if primitive.name in ("all_gather", "all_gather_invariant"):
        return _gathers_over(primitive, params, axes)
    if primitive.name in _LAYOUT_OPS:
        return True
    # a custom_vjp that gathers (spmd.parallel.fp8_gather): the policy sees the call, not
    # the all_gather inside it, and would keep every layer's gathered weights
    inner = params.get("call_jaxpr") or params.get("fun_jaxpr")
    inner = getattr(inner, "jaxpr", inner)
    return any(_gathers_over(e.primitive, e.params, axes) for e in getattr(inner, "eqns", ()))


def _gathers_over(primitive: Any, params: dict, axes: frozenset[str]) -> bool:
    """Whether an op is an all_gather over any of the mesh axes `axes`."""
    if primitive.name not in ("all_gather", "all_gather_invariant"):
        return False
    names = params.get("axis_name")
    names = tuple(names) if isinstance(names, tuple | list) else (names,)
    return bool(axes & set(names))


def remat_policy(policy: Callable | None, gathering: frozenset[str]) -> Callable | None:
    """The remat policy of one layer (None: no remat). While params are gathered per layer
    over the mesh axes `gathering` (explicit ZeRO-3) it is `policy` minus the gathered params
    and their re-layouts: the backward pass gathers them again."""
    if not gathering:
        return policy

    def saveable(primitive: Any, *avals: Any, **params: Any) -> bool:
        if _not_saved(primitive, params, gathering):
            return False
        return True if policy is None else policy(primitive, *avals, **params)

    return saveable


def plain_scan(
    layer: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
    stacked: Any,
    policy: Callable | None,
    unrolled: bool = False,
) -> tuple[Any, Any]:
    """`lax.scan(layer, carry, stacked)`, each layer rematerialised by `policy` (when given);
    `unrolled`: the loop fully unrolled."""
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    return lax.scan(layer, carry, stacked, unroll=unrolled)


def closes_over_a_float(
    layer: Callable[[Any, Any], tuple[Any, Any]], carry: Any, stacked: Any
) -> bool:
    """Whether `layer(carry, state_i)` reads a traced float other than its arguments (a
    closure: `prefetched_scan`'s custom_vjp could not differentiate it, so such a layer runs
    in `plain_scan`). Integer closures (positions, document ids) are fine."""
    first = jax.tree.map(lambda x: x[0], stacked)
    return bool(jax.closure_convert(layer, carry, first)[1])


def prefetched_scan(
    layer: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
    stacked: Any,
    policy: Callable,
    gather: Callable[[Arrays], Arrays],
    while_gathered: Callable[[], contextlib.AbstractContextManager],
    unrolled: bool = False,
) -> tuple[Any, Any]:
    """`lax.scan(layer, carry, stacked)` with ZeRO-3 prefetch: (final carry, stacked ys).

    `layer(carry, state_i) -> (carry, y)` is one layer on the i-th slice of `stacked` (a pytree
    of arrays with a leading layers dim, at least 2 layers); `gather(shards)` turns one layer's
    param shards (the leaves of a slice, in `jax.tree.flatten` order) into whole params, and
    inside `while_gathered()` the layer's own gathers are no-ops. `policy` is the remat policy
    of one layer (`remat_policy`'s: gathered params are never saved); `unrolled`: both loops
    fully unrolled."""
    treedef = jax.tree.structure(stacked)

    def run(carry: Any, whole: Arrays) -> tuple[Any, Any]:
        with while_gathered():
            return layer(carry, jax.tree.unflatten(treedef, whole))

    pullbacks = _Pullbacks(jax.checkpoint(run, policy=policy, prevent_cse=False))
    plan = _Plan(gather, pullbacks, unrolled)

    @jax.custom_vjp
    def scan(carry: Any, stacked: Any) -> tuple[Any, Any]:
        return _forward(plan, carry, jax.tree.leaves(stacked), with_residuals=False)[0]

    def scan_fwd(carry: Any, stacked: Any) -> tuple[tuple, tuple]:
        return _forward(plan, carry, jax.tree.leaves(stacked), with_residuals=True)

    def scan_bwd(residuals: tuple, cotangents: tuple) -> tuple[Any, Any]:
        d_carry, d_shards = _backward(plan, residuals, cotangents)
        return d_carry, jax.tree.unflatten(treedef, d_shards)

    scan.defvjp(scan_fwd, scan_bwd)
    return scan(carry, stacked)


@dataclasses.dataclass(frozen=True)
class _Plan:
    gather: Callable[[Arrays], Arrays]  # one layer's shards -> its whole params
    pullbacks: _Pullbacks  # the layer's vjp, residuals kept without its gathered params
    unrolled: bool  # both loops fully unrolled


def _at(tree: Any, i: jax.Array | int) -> Any:
    """Slice i of every leaf's leading (layers) dim."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _forward(plan: _Plan, carry: Any, shards: Arrays, with_residuals: bool) -> tuple:
    """((final carry, stacked ys), residuals): a scan whose iteration i first gathers layer
    i+1's params (the last layer's again in the last iteration), then runs layer i on the
    params it carries in. Residuals: each layer's kept ones (stacked), the last layer's
    params whole, and the shards."""
    last = shards[0].shape[0] - 1

    def step(state: tuple, i: jax.Array) -> tuple[tuple, tuple]:
        carry, whole = state
        # nothing in this iteration waits for it
        upcoming = plan.gather(_at(shards, jnp.minimum(i + 1, last)))
        carry, y, kept = plan.pullbacks.forward(carry, whole, with_residuals)
        return (carry, upcoming), (y, kept)

    start = (carry, plan.gather(_at(shards, 0)))
    (carry, whole_last), (ys, kept) = lax.scan(
        step, start, jnp.arange(last + 1), unroll=plan.unrolled
    )
    return (carry, ys), (kept, whole_last, shards)


def _backward(plan: _Plan, residuals: tuple, cotangents: tuple) -> tuple[Any, Arrays]:
    """(the carry's cotangent, the shards' cotangents): a reverse scan from the last layer,
    whose params the forward pass kept whole; iteration i first gathers layer i-1's params
    (layer 0's again in the last iteration), then applies layer i's vjp."""
    kept, whole_last, shards = residuals
    d_carry, d_ys = cotangents

    def step(state: tuple, i: jax.Array) -> tuple[tuple, Arrays]:
        d_carry, whole = state
        upcoming = plan.gather(_at(shards, jnp.maximum(i - 1, 0)))
        cotangent = (d_carry, _at(d_ys, i))
        d_carry, d_shards = plan.pullbacks.backward(
            _at(kept, i), whole, cotangent, _at(shards, i), plan.gather
        )
        return (d_carry, upcoming), [d_shards[k] for k in floats]

    # integer shards (a QLoRA base's) have float0 cotangents, which a scan does not stack
    floats = [k for k, x in enumerate(shards) if jnp.issubdtype(x.dtype, jnp.inexact)]
    layers = jnp.arange(shards[0].shape[0])
    (d_carry, _), d_floats = lax.scan(
        step, (d_carry, whole_last), layers, reverse=True, unroll=plan.unrolled
    )
    d_shards: list[Any] = [np.zeros(x.shape, jax.dtypes.float0) for x in shards]
    for k, d in zip(floats, d_floats, strict=True):
        d_shards[k] = d
    return d_carry, d_shards


class _Pullbacks:
    """One layer's `jax.vjp`, its residuals stored without the gathered params and completed
    with them again in the backward pass. Where each residual goes (the vjp's pytree, which
    residual is which gathered param, the constants) is static and recorded while the forward
    pass is traced (every layer's is the same: one loop body)."""

    def __init__(self, checkpointed: Callable) -> None:
        self.checkpointed = checkpointed
        self.layout: tuple | None = None

    def forward(
        self, carry: Any, whole: Arrays, with_residuals: bool = True
    ) -> tuple[Any, Any, Arrays | None]:
        """(carry, y, the residuals to keep; None without residuals) of one layer on its whole
        params."""
        if not with_residuals:
            return (*self.checkpointed(carry, whole), None)
        (carry, y), pullback = jax.vjp(self.checkpointed, carry, whole)
        leaves, tree = jax.tree.flatten(pullback)
        slots = [next((j for j, w in enumerate(whole) if leaf is w), -1) for leaf in leaves]
        constants = {
            k: leaf
            for k, leaf in enumerate(leaves)
            if slots[k] < 0 and not isinstance(leaf, jax.core.Tracer)
        }
        self.layout = (tree, slots, constants)
        kept = [leaf for k, leaf in enumerate(leaves) if slots[k] < 0 and k not in constants]
        return carry, y, kept

    def backward(
        self,
        kept: Arrays,
        whole: Arrays,
        cotangent: tuple,
        shards: Arrays,
        gather: Callable[[Arrays], Arrays],
    ) -> tuple[Any, Arrays]:
        """(the carry's cotangent, the layer's param shards' cotangents)."""
        assert self.layout is not None, "the forward pass records the layout before backward"
        tree, slots, constants = self.layout
        rest = iter(kept)
        leaves = [
            whole[slot] if slot >= 0 else constants[k] if k in constants else next(rest)
            for k, slot in enumerate(slots)
        ]
        d_carry, d_whole = jax.tree.unflatten(tree, leaves)(cotangent)
        return d_carry, _transposed(gather, shards, d_whole)


def _transposed(gather: Callable[[Arrays], Arrays], shards: Arrays, d_whole: Arrays) -> Arrays:
    """The shards' cotangents of the gathered params' `d_whole`: the gather transposed (a
    reduce-scatter) for the floating shards; float0 zeros for integer ones (a QLoRA base's
    codes and scale bits, models/nf4.py), which linear_transpose refuses and which have none."""
    floats = [k for k, x in enumerate(shards) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if len(floats) == len(shards):
        (d_shards,) = jax.linear_transpose(gather, shards)(d_whole)
        return d_shards

    def gather_floats(some: Arrays) -> Arrays:
        every = list(shards)
        for k, x in zip(floats, some, strict=True):
            every[k] = x
        whole = gather(every)
        return [whole[k] for k in floats]

    picked = [shards[k] for k in floats]
    (d_floats,) = jax.linear_transpose(gather_floats, picked)([d_whole[k] for k in floats])
    out: list[Any] = [np.zeros(x.shape, jax.dtypes.float0) for x in shards]
    for k, d in zip(floats, d_floats, strict=True):
        out[k] = d
    return out
