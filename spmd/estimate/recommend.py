"""Choose a layout (mesh dp, fsdp, tp, pp and ZeRO stage) for a model on a cluster.

The order of concerns: the layout must fit in memory; tensor parallelism stays inside a node
(its per-layer activation all-reduces need the fast links); among the layouts that remain, the
one with the least communication and pipeline bubble per unit of compute wins (no overlap of
communication with compute is assumed). Ties go to the simpler layout. Units: bytes, seconds,
bytes/s, FLOP/s; GB = 1e9 bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from spmd.errors import UsageError
from spmd.estimate import cost
from spmd.parallel.mesh import format_mesh


@dataclasses.dataclass(frozen=True)
class Scored:
    """A candidate layout and what it costs per optimizer step on one device."""

    setup: cost.Setup
    memory: dict  # cost.memory
    comm_s: float  # seconds of collectives
    bubble_s: float  # seconds the pipeline idles
    compute_s: float  # seconds of useful compute

    @property
    def overhead_ratio(self) -> float:
        """(communication + bubble) / compute: the cost of the layout per unit of compute."""
        return (self.comm_s + self.bubble_s) / self.compute_s

    def label(self) -> str:
        return f"{format_mesh(self.setup.mesh)} zero {self.setup.zero}"


@dataclasses.dataclass(frozen=True)
class Recommendation:
    best: Scored
    reasons: list[str]
    considered: int  # layouts valid for the model and batch
    fitting: int  # of those, layouts that fit in memory
    runner_up: Scored | None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(base: cost.Setup, devices: int, devices_per_node: int) -> Iterator[cost.Setup]:
    """Every mesh of `devices` devices with tp inside a node, and each ZeRO stage that means
    something for it (0 without an fsdp axis, 1-3 with one), that the model and batch allow."""
    for tensor in _divisors(devices):
        if tensor > devices_per_node or devices_per_node % tensor:
            continue
        for pipeline in _divisors(devices // tensor):
            for fsdp in _divisors(devices // (tensor * pipeline)):
                data = devices // (tensor * pipeline * fsdp)
                mesh = {"data": data, "pipeline": pipeline, "fsdp": fsdp, "tensor": tensor}
                for zero in (1, 2, 3) if fsdp > 1 else (0,):
                    setup = dataclasses.replace(base, mesh=mesh, zero=zero)
                    try:
                        cost.check_setup(setup)
                    except UsageError:
                        continue
                    yield setup


def score(s: cost.Setup, net: cost.Network, flops: float, overhead: float, hbm: float) -> Scored:
    """Memory and step-time terms of one layout (`flops` per device per second; `overhead` and
    `hbm` bytes per device)."""
    with_bubble = cost.compute_time(s, flops)
    useful = cost.flops_per_step(s) / s.devices / flops
    comm = sum(cost.comm_time(s, c, net) for c in cost.collectives(s))
    return Scored(s, cost.memory(s, overhead, hbm), comm, with_bubble - useful, useful)


def _simplicity(s: Scored) -> tuple:
    mesh = s.setup.mesh
    return (mesh["pipeline"], mesh["tensor"], s.setup.zero, mesh["fsdp"])


def recommend(
    base: cost.Setup, net: cost.Network, flops: float, overhead: float, hbm: float
) -> Recommendation:
    """The best layout of base.devices devices for base's model and batch, with reasons.

    If nothing fits, the layout needing the least memory is returned (memory["fits"] False).
    Raises UsageError when no mesh is valid at all (e.g. the batch splits no way)."""
    scored = [
        score(s, net, flops, overhead, hbm)
        for s in layouts(base, base.devices, net.devices_per_node)
    ]
    if not scored:
        raise UsageError(
            f"--recommend found no valid mesh of {base.devices} devices for --batch "
            f"{base.batch} x --accum {base.accum}; use a batch divisible by more device counts"
        )
    fitting = sorted(
        (s for s in scored if s.memory["fits"]),
        key=lambda s: (round(s.overhead_ratio, 4), _simplicity(s)),
    )
    if fitting:
        best, runner_up = fitting[0], (fitting[1] if len(fitting) > 1 else None)
    else:
        best, runner_up = min(scored, key=lambda s: s.memory["total"]), None
    return Recommendation(
        best, reasons(best, scored, runner_up, net), len(scored), len(fitting), runner_up
    )


def ms(seconds: float) -> str:
    """A duration with three significant digits, in ms below a second, else in s."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def reasons(
    best: Scored, scored: list[Scored], runner_up: Scored | None, net: cost.Network
) -> list[str]:
    """Short lines saying why `best` was chosen among `scored`."""
    s, mem = best.setup, best.memory
    mesh, lines = s.mesh, []
    ddp = next((c for c in scored if c.setup.mesh["data"] == s.devices), None)
    if ddp is not None and not ddp.memory["fits"]:
        lines.append(
            f"dp={s.devices} alone (DDP) needs {_gb(ddp.memory['total'])} per device, over "
            f"the {_gb(mem['hbm'])} of HBM"
        )
    elif ddp is not None and ddp is not best:
        lines.append(f"dp={s.devices} alone (DDP) fits but costs ratio {ddp.overhead_ratio:.3g}")
    if mesh["tensor"] > 1:
        tp = [c for c in cost.collectives(s) if c.axes == ("tensor",)]
        seconds = sum(cost.comm_time(s, c, net) for c in tp)
        lines.append(
            f"tp={mesh['tensor']}: fits within a node of {net.devices_per_node}, so its "
            f"{sum(c.count for c in tp)} activation all-reduces per step ({ms(seconds)}) use "
            f"the {net.intra_bandwidth / 1e9:g} GB/s links"
        )
    if mesh["pipeline"] > 1:
        lines.append(
            f"pp={mesh['pipeline']}: stages of {s.shape.n_layers // mesh['pipeline']} of the "
            f"{s.shape.n_layers} layers; the bubble costs {ms(best.bubble_s)} per step with "
            f"{s.accum} micro-batches"
        )
    if mesh["fsdp"] > 1:
        what = {1: "optimizer state", 2: "grads and optimizer state"}.get(
            s.zero, "params, grads and optimizer state"
        )
        lines.append(f"fsdp={mesh['fsdp']} with ZeRO-{s.zero}: {what} split {mesh['fsdp']} ways")
    if mesh["data"] > 1:
        ways = s.sharded_fsdp * mesh["tensor"] * mesh["pipeline"]
        share = f"1/{ways} of the gradients" if ways > 1 else "all the gradients"
        lines.append(f"dp={mesh['data']}: replicas that all-reduce the {share} each holds")
    verdict = "fits" if mem["fits"] else "does NOT fit"
    lines.append(
        f"memory: {_gb(mem['total'])} of {_gb(mem['hbm'])} per device {verdict}, headroom "
        f"{_gb(mem['headroom'])}"
    )
    fitting = sum(c.memory["fits"] for c in scored)
    if not fitting:
        lines.append(
            f"none of the {len(scored)} layouts fits; this one needs the least memory: try "
            f"--remat full, more --accum, --precision bf16, or more devices"
        )
        return lines
    lines.append(
        f"comm {ms(best.comm_s)} + bubble {ms(best.bubble_s)} per {ms(best.compute_s)} of "
        f"compute (ratio {best.overhead_ratio:.3g}): the least of {fitting} fitting layouts"
    )
    if runner_up is not None:
        lines.append(f"runner-up: {runner_up.label()} at ratio {runner_up.overhead_ratio:.3g}")
    return lines
