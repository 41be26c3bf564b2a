"""How many bytes one device can hold: what a compiled step or a key/value cache is compared
with before anything is allocated (spmd.run.checks.check_step_fits, spmd.generate).

On a GPU (or TPU) it is the allocator's limit, `memory_stats()["bytes_limit"]`, of the
smallest local device. XLA:CPU keeps no such limit: its devices, simulated or not, share the
host's memory, so one CPU device's share is the host's physical memory (or a smaller cgroup
limit) divided by the CPU devices of this process. Physical, not currently available memory:
a refusal must be certain, and what other processes hold now changes from second to second.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from spmd.estimate.units import binary

# cgroup v2 then v1 files with the memory limit of a container ("max": none)
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Bytes one device can hold, and what that figure is (for messages)."""

    bytes: int
    source: str  # e.g. "host memory 23.4 GiB shared by 8 CPU devices"


def device_capacity(devices: list[Any]) -> Capacity | None:
    """The capacity of one of `devices` (jax devices of this process), None where unknown."""
    if not devices:
        return None
    if devices[0].platform == "cpu":
        host = host_memory()
        if host is None:
            return None
        shared = f"host memory {binary(host)} shared by {len(devices)} CPU device(s)"
        return Capacity(host // len(devices), shared)
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if not all(limits):
        return None
    limit = min(int(b) for b in limits if b)
    return Capacity(limit, f"{devices[0].device_kind} memory limit {binary(limit)}")


def host_memory() -> int | None:
    """Physical memory of this host in bytes, or the cgroup's limit when smaller; None when
    the system says neither."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that knows
        physical = None
    limits = [physical] if physical and physical > 0 else []
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            limits.append(int(text))
    return min(limits) if limits else None
