"""Parse a mesh string such as "dp=8,tp=8", check it against the devices, build the Mesh.

The mesh always has the five axes of MESH_AXES (size-1 axes cost nothing), ordered so that
`tensor` is innermost: neighbouring device ids share a tensor group, which keeps the chattiest
collectives on the fastest links. On a CPU-only machine the devices a mesh needs can be
simulated (`simulate_cpu_devices`), which must happen before JAX starts its backend.
"""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Any

import jax
import numpy as np

from spmd.errors import UsageError
from spmd.parallel import huge_pages

# Outermost first. `data` is outermost so that, across hosts, plain replication (the cheapest
# collective per step) is what crosses the slow links; `tensor` is innermost.
# `context` (context parallelism: every activation's length split, attention as a ring) sits
# next to `tensor`: its ring sends key/value blocks every layer.
MESH_AXES = ("data", "pipeline", "fsdp", "expert", "context", "tensor")

AXIS_ALIASES = {
    "data": "data",
    "dp": "data",
    "fsdp": "fsdp",
    "tensor": "tensor",
    "tp": "tensor",
    "pipeline": "pipeline",
    "pp": "pipeline",
    "expert": "expert",
    "ep": "expert",
    "context": "context",
    "cp": "context",
}

# Mesh axes that split the batch (every data-parallel axis).
# `expert` is one of them: the devices that split the experts also split the tokens, as in
# DeepSpeed-MoE and MaxText; the params that are not experts are replicated over it (DDP).
BATCH_AXES = ("data", "fsdp", "expert")


def check_section(section: Any) -> None:
    """UsageError for the values of a mesh section (spmd.sections.MeshConfig: spmd.generate's,
    spmd.convert's) out of range, before any device work: --devices below 0, a --zero that is
    no ZeRO stage, a --mesh that does not parse."""
    from spmd.parallel.rules import ZERO_CHOICES, ZERO_STAGES

    if section.devices < 0:
        raise UsageError(f"--devices {section.devices} must be >= 0 (0: as many as the mesh needs)")
    if section.zero not in ZERO_STAGES:
        raise UsageError(f"--zero {section.zero} is not a ZeRO stage; use {ZERO_CHOICES}")
    check_stage_zero(section.zero, parse_mesh(section.mesh))
    check_devices(section.mesh, section.devices)


def check_stage_zero(zero: int, sizes: dict[str, int], flag: str = "--mesh") -> None:
    """UsageError for ZeRO stage 0 (plain DDP: nothing sharded over fsdp) with an fsdp axis,
    which would only replicate: its devices belong on dp."""
    if zero == 0 and sizes.get("fsdp", 1) != 1:
        raise UsageError(
            f"--zero 0 (plain DDP) shards nothing over fsdp, but {flag} has fsdp="
            f"{sizes['fsdp']}: put those devices on dp (dp={sizes['fsdp']}) or use --zero 1, 2 or 3"
        )


def check_devices(mesh: str, devices: int, n_processes: int = 1) -> None:
    """UsageError for a --mesh that does not parse, or one (or a --devices) that would make a
    CPU-only process simulate more devices than the host can start."""
    sizes = parse_mesh(mesh)
    if devices:
        check_simulated(devices, f"--devices {devices}")
    needed = devices_needed(sizes)
    if not devices and needed and cpu_only():
        check_simulated(needed // max(n_processes, 1), f"--mesh {mesh}")


def parse_mesh(spec: str, flag: str = "--mesh") -> dict[str, int]:
    """Parse "dp=2,fsdp=2,tp=2" into {"data": 2, "pipeline": 1, "fsdp": 2, "tensor": 2}.

    Sizes are device counts per axis; at most one axis may be -1 ("the rest"), which
    `resolve_mesh` fills in. Unnamed axes are 1. Items are AXIS=SIZE separated by commas
    (spaces around them are fine); an empty item ("dp=2,,tp=2", a trailing comma) or an empty
    spec is a UsageError, as is a size that is not a plain decimal integer (Python's int()
    would take "1_6" or non-ASCII digits). `flag` names the flag in messages (--dcn-mesh).
    """
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen: set[str] = set()
    valid = ", ".join(sorted(AXIS_ALIASES))
    if not spec.strip():
        raise UsageError(f"{flag} {spec!r} names no axis; give AXIS=SIZE,... e.g. dp=2,tp=4")
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise UsageError(f"{flag} {spec!r} has an empty item; separate AXIS=SIZE by one comma")
        name, eq, value = part.partition("=")
        axis = AXIS_ALIASES.get(name.strip().lower())
        if not eq or axis is None:
            raise UsageError(f"{flag} {spec!r}: {part!r} is not AXIS=SIZE with AXIS one of {valid}")
        if axis in seen:
            raise UsageError(f"{flag} {spec!r}: axis {axis!r} is given twice")
        if not re.fullmatch(r"-?[0-9]+", value.strip()):
            raise UsageError(f"{flag} {spec!r}: size {value!r} of {axis!r} is not an integer")
        size = int(value)
        if size >= MAX_AXIS_SIZE:
            raise UsageError(
                f"{flag} {spec!r}: size {size} of {axis!r} is beyond any device count (at most "
                f"{MAX_AXIS_SIZE - 1})"
            )
        if size < 1 and size != -1:
            raise UsageError(
                f"{flag} {spec!r}: size {size} of {axis!r} must be a positive integer or -1"
            )
        seen.add(axis)
        sizes[axis] = size
    if list(sizes.values()).count(-1) > 1:
        raise UsageError(f"{flag} {spec!r}: only one axis may be -1 (the rest of the devices)")
    return sizes


# An axis size beyond 2**31 is no device count (and past 2**63 no integer numpy can hold).
MAX_AXIS_SIZE = 2**31
# XLA's CPU client takes about 100 KB and 2 ms per simulated device to start, growing faster
# than linearly (4096 devices: 9 s and 0.6 GB; 100000 would take minutes and 10 GB before any
# check could refuse a mesh), so one process simulates at most this many.
MAX_SIMULATED_DEVICES = 4096


def check_simulated(count: int, flag: str) -> None:
    """UsageError when `count` simulated CPU devices per process is more than a process can
    start (`flag` names what asked for them); checked before anything is allocated."""
    if count > MAX_SIMULATED_DEVICES:
        raise UsageError(
            f"{flag} asks for {count} simulated CPU devices in one process, more than a process "
            f"can start (at most {MAX_SIMULATED_DEVICES}); give a smaller count or mesh"
        )


def resolve_mesh(sizes: dict[str, int], n_devices: int) -> dict[str, int]:
    """Fill in a -1 axis and check that the product of axis sizes equals `n_devices`."""
    known = math.prod(s for s in sizes.values() if s != -1)
    spec = format_mesh(sizes)
    if -1 in sizes.values():
        if n_devices % known:
            raise UsageError(
                f"--mesh {spec}: the fixed axes multiply to {known}, which does not divide the "
                f"{n_devices} devices; choose sizes whose product divides {n_devices}"
            )
        sizes = {a: (n_devices // known if s == -1 else s) for a, s in sizes.items()}
    product = math.prod(sizes.values())
    if product != n_devices:
        raise UsageError(
            f"--mesh {spec}: the axis sizes multiply to {product} but there are {n_devices} "
            f"devices; make the product {n_devices}, or use -1 for one axis, or pass "
            f"--devices {product} to simulate {product} CPU devices"
        )
    return sizes


def format_mesh(sizes: dict[str, int]) -> str:
    """The short form of a mesh, e.g. "dp=2,fsdp=2,tp=2" (size-1 axes left out)."""
    short = {
        "data": "dp",
        "fsdp": "fsdp",
        "tensor": "tp",
        "pipeline": "pp",
        "expert": "ep",
        "context": "cp",
    }
    parts = [f"{short[a]}={s}" for a, s in sizes.items() if s != 1]
    return ",".join(parts) or "dp=1"


def devices_needed(sizes: dict[str, int]) -> int | None:
    """Device count a parsed mesh needs, or None when an axis is -1 (any count works)."""
    return None if -1 in sizes.values() else math.prod(sizes.values())


def cpu_only() -> bool:
    """True when JAX will run on the host CPU: no GPU/TPU plugin, or JAX_PLATFORMS=cpu.

    Decided without starting the JAX backend, so that CPU devices can still be simulated.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.values["jax_platforms"] or "")
    return huge_pages.runs_on_cpu(platforms)


def simulate_cpu_devices(count: int, announce: bool = True) -> bool:
    """Make JAX's CPU backend expose `count` devices. Before the backend starts this sets the
    count; in a process where JAX already runs (a notebook, a test session) a backend with at
    least `count` CPU devices serves as it is (returns False), and fewer is a UsageError."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend started already: its devices are what there is
        running = len(jax.devices("cpu"))
        if running < count:
            raise UsageError(
                f"{count} CPU devices are needed, but JAX already started in this process "
                f"with {running}; set the count before JAX starts (spmd.simulate_cpu_devices)"
            ) from None
        return False
    if announce:
        print(f"spmd: simulating {count} CPU devices on this host", file=sys.stderr)
    return True


def dcn_split(
    sizes: dict[str, int], n_hosts: int, dcn_spec: str = "", devices_per_host: int = 0
) -> dict[str, int]:
    """How many ways of each axis cross hosts (the DCN mesh); the rest stays within a host.

    With `dcn_spec` (e.g. "dp=2") each given size must divide that axis of the global mesh and
    the sizes must multiply to `n_hosts`. Without it the outermost data-parallel ways cross
    hosts first (data, then fsdp, pipeline) and `tensor` last. A `tensor` axis that would
    cross hosts although it fits within one is reported on stderr; a split that cannot be
    laid out is a UsageError.
    """
    sizes = {**dict.fromkeys(MESH_AXES, 1), **sizes}  # absent axes have size 1
    mesh_text = format_mesh(sizes)
    if dcn_spec:
        dcn = parse_mesh(dcn_spec, "--dcn-mesh")
        for axis, ways in dcn.items():
            if ways == -1 or sizes[axis] % ways:
                raise UsageError(
                    f"--dcn-mesh {dcn_spec}: {axis}={ways} must divide {axis}={sizes[axis]} "
                    f"of --mesh {mesh_text}"
                )
        if math.prod(dcn.values()) != n_hosts:
            raise UsageError(
                f"--dcn-mesh {dcn_spec}: the sizes multiply to {math.prod(dcn.values())}, "
                f"but there are {n_hosts} processes; make the product {n_hosts}"
            )
    else:
        dcn, left = dict.fromkeys(MESH_AXES, 1), n_hosts
        for axis in ("data", "fsdp", "expert", "pipeline", "tensor"):
            dcn[axis] = math.gcd(sizes[axis], left)
            left //= dcn[axis]
        if left > 1:
            raise UsageError(
                f"--mesh {mesh_text} cannot be split over {n_hosts} processes: no axis holds "
                f"the remaining factor {left}; make an axis a multiple of {n_hosts}"
            )
    if dcn["tensor"] > 1 and devices_per_host and sizes["tensor"] <= devices_per_host:
        print(
            f"spmd: warning: tensor={sizes['tensor']} crosses hosts ({dcn['tensor']} ways) "
            f"although it fits within one host of {devices_per_host} devices; tensor-parallel "
            f"all-reduces will run over the slow network",
            file=sys.stderr,
        )
    return dcn


def build_mesh(
    sizes: dict[str, int], devices: list | None = None, dcn: dict[str, int] | None = None
) -> jax.sharding.Mesh:
    """Build a Mesh with axes MESH_AXES (all Auto) over `devices` (default: all devices).

    `sizes` may hold one -1; the product must equal the device count. With `dcn` (from
    `dcn_split`), a hybrid mesh: `dcn[axis]` ways of each axis cross processes (hosts) and the
    rest stay within one.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh({**dict.fromkeys(MESH_AXES, 1), **sizes}, len(devices))  # absent: 1
    shape = tuple(sizes[a] for a in MESH_AXES)
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if dcn is not None and math.prod(dcn.values()) > 1:
        from jax.experimental import mesh_utils

        dcn_shape = tuple(dcn.get(a, 1) for a in MESH_AXES)
        ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape, strict=True))
        grid = mesh_utils.create_hybrid_device_mesh(
            ici_shape, dcn_shape, devices, process_is_granule=True
        )
        return jax.sharding.Mesh(grid, MESH_AXES, axis_types=axis_types)
    if len(devices) == len(jax.devices()):
        # Let JAX order devices for the physical topology (ICI rings on TPU/GPU).
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    return jax.sharding.Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def axis_size(mesh: jax.sharding.Mesh, axes: str | tuple[str, ...] | None) -> int:
    """Number of devices along one mesh axis or the product along several (1 for None)."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def setup_mesh(mesh: str, devices: int = 0, dcn_mesh: str = "", n_processes: int = 1) -> Any:
    """The global mesh of `--mesh` (with `--devices` simulated CPU devices per process, or as many
    as the mesh needs on a CPU-only machine; call before anything starts JAX's backend); in a
    multi-process job, a hybrid mesh whose `--dcn-mesh` ways cross processes."""
    from spmd.parallel import distributed

    if devices < 0:
        raise UsageError(f"--devices {devices} must be >= 0 (0: as many as the mesh needs)")
    sizes = parse_mesh(mesh)
    needed = devices_needed(sizes)
    if needed and needed % n_processes:
        raise UsageError(
            f"--mesh {mesh} needs {needed} devices, which {n_processes} processes cannot "
            f"share evenly; use a mesh whose product is a multiple of {n_processes}"
        )
    local = devices or distributed.local_devices_from_env()
    check_devices(mesh, local, n_processes)
    if local:
        if not cpu_only():
            raise UsageError(
                f"--devices {local} simulates CPU devices, but this machine has "
                f"accelerators; drop --devices to use them"
            )
        simulate_cpu_devices(local, announce=False)
    elif needed and needed > n_processes and cpu_only():
        simulate_cpu_devices(needed // n_processes, announce=n_processes == 1)
    if n_processes == 1:
        count = local or needed  # --devices when given (the mesh must fill it), else the mesh's
        if count and cpu_only() and count < len(jax.devices()):
            # simulated devices started earlier in this process (a notebook, a test session):
            # the run takes as many as --devices (or the mesh) names
            return build_mesh(sizes, jax.devices()[:count])
        return build_mesh(sizes)
    sizes = resolve_mesh(sizes, len(jax.devices()))
    dcn = dcn_split(sizes, n_processes, dcn_mesh, len(jax.local_devices()))
    return build_mesh(sizes, dcn=dcn)
