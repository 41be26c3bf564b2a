"""How a model's stacked layers run: one `lax.scan` over the `layers` dim under a remat policy,
and under ZeRO-3 (explicit executor) with prefetch: the next layer's params are all-gathered
while the current layer computes, in the forward and in the backward pass (double buffering).

The remat policy never saves a param gathered for use (tagged GATHERED by hooks.gather) nor a
value that only re-lays one out: the backward pass gathers again instead, so only one layer is
ever whole (ZeRO-3's memory).

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
  residuals are kept except the gathered params (found by identity among the residuals: the
  policy never saves a value derived from them, `remat_policy`); the last layer's gathered
  params stay whole for the backward pass, which starts with that layer;
- backward: layers in reverse, each one's params gathered one iteration ahead, its residuals
  completed with them, its vjp applied, and the gathered params' cotangent reduce-scattered
  back to shards (the transpose of the all_gather, as autodiff would write it).

Per micro-batch: L layer all-gathers forward and L - 1 backward (2L without prefetch); two
layers' params are whole at once instead of one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
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


def _not_saved(primitive: Any, params: dict) -> bool:
    if primitive.name == "name":
        return params.get("name") == GATHERED
    return primitive.name in ("all_gather", "all_gather_invariant", *_LAYOUT_OPS)


def remat_policy(policy: Callable | None, gathering: bool) -> Callable | None:
    """The remat policy of one layer (None: no remat). While params are gathered per layer
    (`gathering`, explicit ZeRO-3) it is `policy` minus the gathered params and their
    re-layouts: the backward pass gathers them again."""
    if not gathering:
        return policy

    def saveable(primitive: Any, *avals: Any, **params: Any) -> bool:
        if _not_saved(primitive, params):
            return False
        return True if policy is None else policy(primitive, *avals, **params)

    return saveable


def plain_scan(
    layer: Callable[[Any, Any], tuple[Any, Any]], carry: Any, stacked: Any, policy: Callable | None
) -> tuple[Any, Any]:
    """`lax.scan(layer, carry, stacked)`, each layer rematerialised by `policy` (when given)."""
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    return lax.scan(layer, carry, stacked)


def prefetched_scan(
    layer: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
    stacked: Any,
    policy: Callable,
    gather: Callable[[Arrays], Arrays],
    while_gathered: Callable[[], contextlib.AbstractContextManager],
) -> tuple[Any, Any]:
    """`lax.scan(layer, carry, stacked)` with ZeRO-3 prefetch: (final carry, stacked ys).

    `layer(carry, state_i) -> (carry, y)` is one layer on the i-th slice of `stacked` (a pytree
    of arrays with a leading layers dim, at least 2 layers); `gather(shards)` turns one layer's
    param shards (the leaves of a slice, in `jax.tree.flatten` order) into whole params, and
    inside `while_gathered()` the layer's own gathers are no-ops. `policy` is the remat policy
    of one layer (`remat_policy`'s: gathered params are never saved)."""
    treedef = jax.tree.structure(stacked)

    def run(carry: Any, whole: Arrays) -> tuple[Any, Any]:
        with while_gathered():
            return layer(carry, jax.tree.unflatten(treedef, whole))

    plan = _Plan(gather, _Pullbacks(jax.checkpoint(run, policy=policy, prevent_cse=False)))

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


def _at(tree: Any, i: jax.Array | int) -> Any:
    """Slice i of every leaf's leading (layers) dim."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _forward(plan: _Plan, carry: Any, shards: Arrays, with_residuals: bool) -> tuple:
    """((final carry, stacked ys), residuals): layers 0 .. L-2 in a scan whose iteration i
    first gathers layer i+1's params, then runs layer i on the params it carries in; the
    last layer after it. Residuals: the kept ones of layers 0 .. L-2 (stacked) and of the
    last, its whole params, and the shards."""
    n_layers = shards[0].shape[0]

    def step(state: tuple, i: jax.Array) -> tuple[tuple, tuple]:
        carry, whole = state
        upcoming = plan.gather(_at(shards, i + 1))  # nothing in this iteration waits for it
        carry, y, kept = plan.pullbacks.forward("loop", carry, whole, with_residuals)
        return (carry, upcoming), (y, kept)

    start = (carry, plan.gather(_at(shards, 0)))
    (carry, whole), (ys, kept) = lax.scan(step, start, jnp.arange(n_layers - 1))
    carry, y_last, kept_last = plan.pullbacks.forward("last", carry, whole, with_residuals)
    ys = jax.tree.map(lambda many, last: jnp.concatenate([many, last[None]]), ys, y_last)
    return (carry, ys), (kept, kept_last, whole, shards)


def _backward(plan: _Plan, residuals: tuple, cotangents: tuple) -> tuple[Any, Arrays]:
    """(the carry's cotangent, the shards' cotangents): the last layer first on its kept whole
    params, then layers L-2 .. 1 in a reverse scan whose iteration i first gathers layer i-1's
    params, then layer 0 on the params the scan hands over."""
    kept, kept_last, whole_last, shards = residuals
    d_carry, d_ys = cotangents
    last = shards[0].shape[0] - 1

    def layer_grads(site: str, i: Any, res: Any, whole: Arrays, d_carry: Any) -> tuple:
        cotangent = (d_carry, _at(d_ys, i))
        return plan.pullbacks.backward(site, res, whole, cotangent, _at(shards, i), plan.gather)

    upcoming = plan.gather(_at(shards, last - 1))
    d_carry, d_last = layer_grads("last", last, kept_last, whole_last, d_carry)

    def step(state: tuple, i: jax.Array) -> tuple[tuple, Arrays]:
        d_carry, whole = state
        upcoming = plan.gather(_at(shards, i - 1))
        d_carry, d_shards = layer_grads("loop", i, _at(kept, i), whole, d_carry)
        return (d_carry, upcoming), d_shards

    middle = jnp.arange(1, last)
    (d_carry, whole), d_middle = lax.scan(step, (d_carry, upcoming), middle, reverse=True)
    d_carry, d_first = layer_grads("loop", 0, _at(kept, 0), whole, d_carry)
    d_shards = [
        jnp.concatenate([first[None], many, final[None]])
        for first, many, final in zip(d_first, d_middle, d_last, strict=True)
    ]
    return d_carry, d_shards


class _Pullbacks:
    """One layer's `jax.vjp`, its residuals stored without the gathered params and completed
    with them again in the backward pass. Where each residual goes (the vjp's pytree, which
    residual is which gathered param, the constants) is static and recorded per call site
    ("loop": the scan's body, "last": the layer after it) while the forward pass is traced."""

    def __init__(self, checkpointed: Callable) -> None:
        self.checkpointed = checkpointed
        self.layout: dict[str, tuple] = {}

    def forward(
        self, site: str, carry: Any, whole: Arrays, with_residuals: bool = True
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
        self.layout[site] = (tree, slots, constants)
        kept = [leaf for k, leaf in enumerate(leaves) if slots[k] < 0 and k not in constants]
        return carry, y, kept

    def backward(
        self,
        site: str,
        kept: Arrays,
        whole: Arrays,
        cotangent: tuple,
        shards: Arrays,
        gather: Callable[[Arrays], Arrays],
    ) -> tuple[Any, Arrays]:
        """(the carry's cotangent, the layer's param shards' cotangents)."""
        tree, slots, constants = self.layout[site]
        rest = iter(kept)
        leaves = [
            whole[slot] if slot >= 0 else constants[k] if k in constants else next(rest)
            for k, slot in enumerate(slots)
        ]
        d_carry, d_whole = jax.tree.unflatten(tree, leaves)(cotangent)
        (d_shards,) = jax.linear_transpose(gather, shards)(d_whole)
        return d_carry, d_shards
