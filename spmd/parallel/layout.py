"""A run's layout: the mesh, the ZeRO stage of its fsdp axis, and sequence parallelism.

Low in the package order so every package can type a layout (spmd.engine builds on it,
spmd.estimate reads it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
from jax.sharding import NamedSharding, PartitionSpec

from spmd.errors import UsageError
from spmd.parallel.mesh import BATCH_AXES


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the state and the batch live: a mesh, the ZeRO stage of its fsdp axis, and
    whether the residual stream is split along length over `tensor` (sequence parallelism)."""

    mesh: jax.sharding.Mesh
    zero_stage: int = 3  # 0: plain replication (DDP), which needs a mesh without an fsdp axis
    sequence_parallel: bool = False
    # how attention crosses a length split over `context`: a ring of key / value passes
    # (spmd.parallel.ring_attention) or Ulysses' all-to-alls (spmd.parallel.ulysses)
    cp_mode: Literal["ring", "ulysses"] = "ring"

    def __post_init__(self) -> None:
        if self.zero_stage == 0 and self.mesh.shape.get("fsdp", 1) > 1:
            fsdp = self.mesh.shape["fsdp"]
            raise UsageError(
                f"ZeRO stage 0 (plain DDP) shards nothing over fsdp, but the mesh has fsdp="
                f"{fsdp}: put those devices on dp (make_mesh('dp={fsdp}')) or use stage 1, 2 or 3"
            )

    @property
    def data_parallel(self) -> int:
        """Number of ways the batch is split (product of the data-parallel axes)."""
        return math.prod(self.mesh.shape[a] for a in BATCH_AXES)

    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        """Sharding of a [batch, ...] array: the batch split over every data-parallel axis."""
        axes = tuple(a for a in BATCH_AXES if self.mesh.shape[a] > 1)
        return NamedSharding(self.mesh, PartitionSpec(axes or None, *[None] * (ndim - 1)))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())
