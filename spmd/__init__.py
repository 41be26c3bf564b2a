"""spmd: every parallelism strategy from one device mesh with named axes.

The library API (see spmd/api.py and the README's "Use it as a library"):

    make_mesh, sharding_rules, build, put_batch, checkpoints, save, restore
    TrainState, Program                   what `build` returns and what a step updates
    gather, tp_enter, tp_reduce, constrain  hooks a model calls (no-ops outside a layout)
    simulate_cpu_devices                  N CPU devices for a laptop (before JAX starts)

Names resolve on first use, so `import spmd` does not import JAX, Flax or orbax (the launcher
and the CLI must set up devices before JAX starts).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "make_mesh": "spmd.api",
    "sharding_rules": "spmd.api",
    "build": "spmd.api",
    "put_batch": "spmd.api",
    "checkpoints": "spmd.api",
    "save": "spmd.api",
    "restore": "spmd.api",
    "TrainState": "spmd.engine.step",
    "Program": "spmd.engine.step",
    "gather": "spmd.parallel.hooks",
    "tp_enter": "spmd.parallel.hooks",
    "tp_reduce": "spmd.parallel.hooks",
    "constrain": "spmd.parallel.hooks",
    "simulate_cpu_devices": "spmd.parallel.mesh",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spmd' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
