"""Named layouts: a mesh string and a ZeRO stage, which together are a parallelism strategy.

Each preset lives in its own short module whose docstring says which collectives the layout
produces per optimizer step and what they cost, under both executors (`--collectives auto`:
XLA inserts them; `explicit`: spmd.parallel.collectives writes them). Figures are bytes per device
per
step as `--dry-run` reports them (spmd.estimate.hlo: the size of each op's result; on a ring a
device
sends about 2(N-1)/N of an all-reduce's bytes and (N-1)/N of an all-gather's or a
reduce-scatter's result). N is the size of the axis named, P the parameter bytes (fp32),
P_L the part of P in the scanned layers, A the bytes of one layer's input [batch, length,
embed] on one device per micro-batch, L the number of layers, k the micro-batches per step
(--accum). spmd.estimate.theory computes these formulas for a concrete run; `--dry-run` prints them
beside the compiled step's figures. Each step also all-reduces a few 4-byte scalars (the loss
mean, gradient norms). `--layout NAME` fills --mesh and --zero unless they are given.
"""

from __future__ import annotations

from meshes.preset import Preset
from spmd.errors import UsageError

__all__ = ["Preset", "get", "presets"]


def presets() -> dict[str, Preset]:
    """All named layouts, by name."""
    from meshes import ddp, hsdp, long_context, megatron, megatron_sp, three_d, zero1, zero2, zero3

    modules = (ddp, zero1, zero2, zero3, hsdp, megatron, megatron_sp, three_d, long_context)
    return {m.PRESET.name: m.PRESET for m in modules}


def get(name: str) -> Preset:
    """The preset called `name`; UsageError listing the valid names otherwise."""
    table = presets()
    if name not in table:
        raise UsageError(f"--layout {name!r} is not a layout; choose one of {', '.join(table)}")
    return table[name]
