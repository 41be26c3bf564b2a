"""The record every named layout fills in (one module per layout in meshes/)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    mesh: str  # mesh string for spmd.parallel.mesh.parse_mesh; -1 takes the remaining devices
    zero: int  # ZeRO stage of the fsdp axis
    summary: str  # what it is, in one line
    collectives: str  # what crosses the wire per optimizer step
    sequence_parallel: bool = False  # Megatron-SP on the tensor axis (--sequence-parallel)
