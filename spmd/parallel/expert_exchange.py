"""Moving an MoE layer's tokens to the devices that hold their experts and back: the mesh-axis
side of the hooks models/moe.py and models/moe_all_to_all.py call (spmd.parallel.hooks
re-exports them; model code names logical axes only).

Two dispatches use them:

    one-hot (GShard)    to_experts / from_experts: the buffer [expert, batch, capacity, embed]
                        moved by one tiled all_to_all over the axes that split `expert`
                        (explicit) or by a resharding (auto)
    sorted rows         exchange(x): each device's block for device j goes to device j (one
                        tiled all_to_all over those axes, the same op both ways);
                        on_expert_devices(fn, ...) runs `fn` where each device holds its own
                        tokens and experts: directly inside the explicit executor's shard_map,
                        and under the auto executor inside a shard_map over the mesh axes that
                        split the batch, the experts or their hidden dim, with the explicit
                        hooks (tp_enter / tp_reduce) open inside it; exchange_axes() names
                        the axes (the recorded choice)

`exchange_blocked()` says why the sorted all-to-all cannot run on the layout being traced
(None where it can); there models/moe.py keeps the one-hot dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from spmd.parallel import rules
from spmd.parallel import traced_layout as traced


def _constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    auto = traced.activations()
    if auto is None:
        return x
    mesh, table, _ = auto
    spec = rules.partition_spec(names, x.shape, table, mesh, f"activation {names}")
    return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def to_experts(x: jax.Array) -> jax.Array:
    """Dispatch an MoE buffer [expert, batch, capacity, embed] from the devices that hold its
    tokens to those that hold its experts. Explicit: one tiled all_to_all over the mesh axes
    that split `expert`: each device sends its rows for expert block j to device j and gets
    [expert / n, n * batch, capacity, embed]. Auto: the same move as a resharding, which the
    partitioner turns into an all-to-all."""
    if traced.explicit() is None:
        return _constrain(x, ("expert", "batch", None, None))
    axes = traced.split_axes("expert")
    return lax.all_to_all(x, axes, 0, 1, tiled=True) if axes else x


def from_experts(y: jax.Array) -> jax.Array:
    """The inverse of `to_experts`: the experts' outputs back to the devices of their tokens."""
    if traced.explicit() is None:
        return _constrain(y, (None, "batch", None, None))
    axes = traced.split_axes("expert")
    return lax.all_to_all(y, axes, 1, 0, tiled=True) if axes else y


def experts_split() -> bool:
    """Whether the layout being traced splits the MoE experts (logical `expert`) over devices
    (ep or fsdp > 1), so that tokens travel to them; False outside a layout (one device)."""
    if traced.explicit() is not None:
        return bool(traced.split_axes("expert"))
    if (auto := traced.activations()) is None:
        return False
    mesh, table, _ = auto
    return any(mesh.shape[a] > 1 for a in table.get("expert", ()))


def _axes(mesh: Any, table: rules.Rules, name: str) -> tuple[str, ...]:
    return tuple(a for a in table.get(name, ()) if mesh.shape[a] > 1)


def exchange_blocked() -> str | None:
    """Why the sorted rows' all-to-all cannot run on the layout being traced (None: it can):
    a pipeline or context parallelism (their stages and rings are shard_maps of their own),
    or, under the auto executor, mesh axes left out of the activation rules (a vmap owns them)."""
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
    if (layout := traced.explicit()) is not None:
        mesh, table = layout.mesh, layout.compute_rules
    elif (auto := traced.activations()) is not None:
        mesh, table, _ = auto
    else:
        return None
    if mesh.shape["pipeline"] > 1 or traced.chunk_inputs() is not None:
        return "pipeline"
    if mesh.shape["context"] > 1 or traced.manual_context_axis() is not None:
        return "context parallelism"
    covered = {*_axes(mesh, table, "batch"), *_axes(mesh, table, "mlp")}
    if any(size > 1 and axis not in covered for axis, size in mesh.shape.items()):
        return "mesh axes outside the batch and tensor rules"
    return None


def exchange_ways() -> int:
    """Devices the experts are split over (1 outside a manual region or without ep / fsdp)."""
    layout = traced.explicit()
    return math.prod(layout.mesh.shape[a] for a in traced.split_axes("expert")) if layout else 1


def exchange(x: jax.Array) -> jax.Array:
    """x [ways, ...]: block j goes to the j-th device of the experts' split (in the order of the
    experts' blocks) and block i of the result came from device i. One tiled all_to_all; its
    own inverse, and its transpose in the backward pass."""
    axes = traced.split_axes("expert")
    return lax.all_to_all(x, axes, 0, 0, tiled=True) if axes else x


def exchange_axes() -> tuple[str, ...]:
    """The mesh axes over 1 that split the experts in the layout being traced."""
    if traced.explicit() is not None:
        return traced.split_axes("expert")
    if (auto := traced.activations()) is None:
        return ()
    mesh, table, _ = auto
    return _axes(mesh, table, "expert")


def on_expert_devices(fn: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    """fn(x, experts, kept, w_gate, w_up, w_down[, b_gate, b_up, b_down]) -> [batch, pairs,
    embed] run on each device's own sequences (x [batch, length, embed], experts and kept
    [batch, pairs]) and its own block of the experts' weights ([E, embed, mlp] twice, [E, mlp,
    embed]) and biases where given ([E, mlp] twice, [E, embed]: GPT-OSS's), where `exchange`
    moves rows between the devices that split the experts."""
    if traced.explicit() is not None:
        return fn(*args)
    auto = traced.activations()
    assert auto is not None, "on_expert_devices outside a layout: experts_split() is False there"
    mesh, table, sp = auto
    batch, expert, tensor = (_axes(mesh, table, n) for n in ("batch", "expert", "mlp"))

    def spec(*dims: tuple[str, ...] | None) -> PartitionSpec:
        return PartitionSpec(*(d[0] if d and len(d) == 1 else (d or None) for d in dims))

    rows = spec(batch)
    in_specs = (
        rows,
        rows,
        rows,
        spec(expert, None, tensor),
        spec(expert, None, tensor),
        spec(expert, tensor, None),
        *(spec(expert, tensor), spec(expert, tensor), spec(expert, None))[: len(args) - 6],
    )

    # the axes that split the rows but not the weights: the weights are invariant over them,
    # and the gradient of an invariant operand is summed over them (a psum). Cast varying
    # here, once, that sum comes after the kernel; left to the kernel's loop, where each block
    # of rows meets its expert's weights, it was one all-reduce of every expert's weight
    # gradients per block (moe-tiny dp=2,ep=2: 257 per layer and step)
    replicated = tuple(a for a in batch if a not in expert and a not in tensor)
    sum_in_fp32 = _platform(mesh) == "cpu"

    def local(*local_args: jax.Array) -> jax.Array:
        rows, weights = local_args[:3], local_args[3:]  # weights: the matrices, then biases
        if replicated:
            weights = tuple(varying(w, replicated, sum_in_fp32) for w in weights)
        with (
            traced.no_activation_layout(),
            # the explicit hooks read the mesh's axis names and sizes, an abstract mesh's too
            traced.explicit_layout(cast(jax.sharding.Mesh, mesh), 0, sp, prefetch=False),
        ):
            return fn(*rows, *weights)

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=rows,
        axis_names={*batch, *expert, *tensor},
        check_vma=True,
    )
    return mapped(*args)


def varying(w: jax.Array, axes: tuple[str, ...], sum_in_fp32: bool) -> jax.Array:
    """`w` cast varying over `axes` (inside a shard_map with check_vma), so that its gradient
    is summed over them there, once. `sum_in_fp32`: a bf16 / fp16 `w` crosses the cast in
    fp32, so that the sum runs in fp32: what XLA:CPU's all-reduce promotion would make of it,
    except that the pass aborts the compile on the reduction jax emits for this sum (its root
    a copy: moe-tiny dp=2,ep=2 --precision bf16 crashed in AllReducePromotion)."""
    if not (sum_in_fp32 and w.dtype in (jnp.bfloat16, jnp.float16)):
        return lax.pcast(w, axes, to="varying")
    return lax.pcast(w.astype(jnp.float32), axes, to="varying").astype(w.dtype)


def _platform(mesh: Any) -> str:
    """The platform of a mesh's devices (an abstract mesh's too)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return mesh.abstract_device.platform
    return mesh.devices.flat[0].platform
