"""Pallas kernels under the auto executor: a Pallas call is a custom call that XLA's
partitioner cannot split, so under plain jit it would gather every operand whole onto each
device and run the global batch there. `per_shard` runs such a kernel inside a shard_map over
the axes that split its operands' batch (and heads) dims, each device on its own shard."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from spmd.parallel import rules
from spmd.parallel import traced_layout as traced


def kernel_specs(
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    table: rules.Rules,
    shapes: list[tuple[int, ...]],
    names: tuple[tuple[str | None, ...], ...],
) -> tuple[jax.sharding.PartitionSpec, ...]:
    """Each operand's PartitionSpec for a kernel run per shard (hooks.per_shard): its `batch`
    dim split as the activations' rules split it, its `heads` / `kv_heads` dims as well where
    every such dim divides evenly (else every head dim whole, so that query head i still
    meets kv head i // groups on the same device), every other dim whole."""

    def axes(name: str | None) -> tuple[str, ...]:
        return tuple(a for a in table.get(name, ()) if mesh.shape[a] > 1) if name else ()

    def ways(name: str | None) -> int:
        return int(np.prod([mesh.shape[a] for a in axes(name)]))

    head_dims = [
        (shape[i], n) for shape, ns in zip(shapes, names, strict=True)
        for i, n in enumerate(ns) if n in ("heads", "kv_heads")
    ]  # fmt: skip
    split_heads = all(size % ways(n) == 0 for size, n in head_dims)
    kept = {"batch", "heads", "kv_heads"} if split_heads else {"batch"}
    return tuple(
        jax.sharding.PartitionSpec(
            *(
                axes(n) or None if n in kept and shape[i] % ways(n) == 0 else None
                for i, n in enumerate(ns)
            )
        )  # fmt: skip
        for shape, ns in zip(shapes, names, strict=True)
    )


def per_shard(
    kernel: Callable[..., jax.Array], *args: jax.Array, names: tuple[tuple[str | None, ...], ...]
) -> jax.Array:
    """`kernel(*args)` on each device's shard where XLA partitions the layout (the auto
    executor): a Pallas kernel is a custom call XLA's partitioner cannot split, so it would
    gather every operand whole onto each device and run the global batch there. `names`: each
    operand's logical dim names (kernel_specs says which split); the output is
    laid out as the first operand. Elsewhere (explicit executor, one device) `kernel(*args)`."""
    if traced.explicit() is not None or (auto := traced.activations()) is None:
        return kernel(*args)
    mesh, table, _ = auto
    specs = kernel_specs(mesh, table, [a.shape for a in args], names)
    used = {
        axis
        for spec in specs
        for part in spec
        if part
        for axis in ((part,) if isinstance(part, str) else part)
    }
    if not used:
        return kernel(*args)

    def local(*shards: jax.Array) -> jax.Array:
        with traced.no_activation_layout():  # shards: nothing left for XLA to lay out here
            return kernel(*shards)

    shards = jax.shard_map(
        local, mesh=mesh, in_specs=specs, out_specs=specs[0], axis_names=used, check_vma=False
    )
    return shards(*args)
