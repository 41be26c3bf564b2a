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
    n_layers = jax.tree.leaves(stacked)[0].shape[0]

    def run(carry: Any, whole: Arrays) -> tuple[Any, Any]:
        with while_gathered():
            return layer(carry, jax.tree.unflatten(treedef, whole))

    checkpointed = jax.checkpoint(run, policy=policy, prevent_cse=False)
    pullbacks = _Pullbacks(checkpointed)

    def forward(carry: Any, shards: Arrays, with_residuals: bool) -> tuple[Any, Any]:
        def layer_shards(i: jax.Array | int) -> Arrays:
            return [lax.dynamic_index_in_dim(s, i, keepdims=False) for s in shards]

        def step(state: tuple, i: jax.Array) -> tuple[tuple, tuple]:
            carry, whole = state
            upcoming = gather(layer_shards(i + 1))  # nothing in this iteration waits for it
            if with_residuals:
                carry, y, kept = pullbacks.forward("loop", carry, whole)
            else:
                (carry, y), kept = checkpointed(carry, whole), None
            return (carry, upcoming), (y, kept)

        start = (carry, gather(layer_shards(0)))
        (carry, whole), (ys, kept) = lax.scan(step, start, jnp.arange(n_layers - 1))
        if with_residuals:
            carry, y_last, kept_last = pullbacks.forward("last", carry, whole)
        else:
            (carry, y_last), kept_last = checkpointed(carry, whole), None
        ys = jax.tree.map(lambda many, last: jnp.concatenate([many, last[None]]), ys, y_last)
        return (carry, ys), (kept, kept_last, whole, shards)

    def backward(residuals: tuple, cotangents: tuple) -> tuple[Any, Any]:
        kept, kept_last, whole_last, shards = residuals
        d_carry, d_ys = cotangents

        def layer_shards(i: jax.Array | int) -> Arrays:
            return [lax.dynamic_index_in_dim(s, i, keepdims=False) for s in shards]

        def d_y(i: jax.Array | int) -> Any:
            return jax.tree.map(lambda d: lax.dynamic_index_in_dim(d, i, keepdims=False), d_ys)

        def kept_of(i: jax.Array | int) -> Any:
            return jax.tree.map(lambda r: lax.dynamic_index_in_dim(r, i, keepdims=False), kept)

        last = n_layers - 1
        upcoming = gather(layer_shards(last - 1))
        d_carry, d_last = pullbacks.backward(
            "last", kept_last, whole_last, (d_carry, d_y(last)), layer_shards(last), gather
        )

        def step(state: tuple, i: jax.Array) -> tuple[tuple, Arrays]:  # layers L-2 .. 1
            d_carry, whole = state
            upcoming = gather(layer_shards(i - 1))
            d_carry, d_shards = pullbacks.backward(
                "loop", kept_of(i), whole, (d_carry, d_y(i)), layer_shards(i), gather
            )
            return (d_carry, upcoming), d_shards

        middle = jnp.arange(1, last)
        (d_carry, whole), d_middle = lax.scan(step, (d_carry, upcoming), middle, reverse=True)
        d_carry, d_first = pullbacks.backward(
            "loop", kept_of(0), whole, (d_carry, d_y(0)), layer_shards(0), gather
        )
        d_shards = [
            jnp.concatenate([first[None], many, final[None]])
            for first, many, final in zip(d_first, d_middle, d_last, strict=True)
        ]
        return d_carry, jax.tree.unflatten(treedef, d_shards)

    @jax.custom_vjp
    def scan(carry: Any, stacked: Any) -> tuple[Any, Any]:
        return forward(carry, jax.tree.leaves(stacked), with_residuals=False)[0]

    def scan_fwd(carry: Any, stacked: Any) -> tuple[tuple, tuple]:
        return forward(carry, jax.tree.leaves(stacked), with_residuals=True)

    scan.defvjp(scan_fwd, backward)
    return scan(carry, stacked)


class _Pullbacks:
    """One layer's `jax.vjp`, its residuals stored without the gathered params and completed
    with them again in the backward pass. Where each residual goes (the vjp's pytree, which
    residual is which gathered param, the constants) is static and recorded per call site
    ("loop": the scan's body, "last": the layer after it) while the forward pass is traced."""

    def __init__(self, checkpointed: Callable) -> None:
        self.checkpointed = checkpointed
        self.layout: dict[str, tuple] = {}

    def forward(self, site: str, carry: Any, whole: Arrays) -> tuple[Any, Any, Arrays]:
        """(carry, y, the residuals to keep) of one layer on its whole params."""
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
