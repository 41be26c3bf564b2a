"""Search every knob of a layout for the fastest one that fits.

The knobs: the mesh (dp, fsdp, tp, pp; ep for an MoE; cp when nothing fits without it), the
ZeRO stage, --sequence-parallel at tp > 1, the per-device micro-batch (hence --accum, or the
pipeline's --microbatches), --remat, with pp > 1 the schedule (1f1b, or interleaved with 2 or
4 chunks per stage), and --offload optimizer and --remat offload when nothing fits without host
memory. The order of concerns is an engineer's:

1. constraints: tp inside a node and dividing the heads, mlp and vocabulary; pp dividing the
   layers; the batch splitting evenly; the step fitting in the HBM with the overhead reserved,
   and what it keeps in host memory in the node's;
2. the least estimated time per sequence (spmd.estimate.timing: compute at the sustained
   FLOP rate + exposed communication + pipeline bubble + exposed host transfers), which is
   the step time when every candidate runs the same batch;
3. ties (equal to 3 significant digits) to the simpler layout: no pipeline, then no tp, no
   cp, no ep, the lower ZeRO stage, optimizer offload before params offload, no SP, fewer chunks,
   less recomputation, fewer mesh axes, the larger micro-batch, the least memory.

Expert parallelism (ep, an MoE's only) is tried at every size dividing the experts that the
data-parallel devices leave: ep devices split the batch as dp's do and the experts between
them (with fsdp's: ep x fsdp must divide the experts, spmd.estimate.cost.check_setup), and
their token all-to-alls (spmd.estimate.comms.expert_collectives) sit on the critical path of
the step time. A dense model's meshes carry no expert axis, so its search is unchanged.

Context parallelism (cp, inside a node beside tp) is searched only when no layout without it
fits: its ring sends sit on the critical path, and the model does not see what splitting a
sequence costs the kernels, so it is the tool for sequences whose activations do not fit.
Sequence parallelism is tried at every tp > 1: it moves the same bytes and keeps less.
Host memory (--offload optimizer, --remat offload) last, only when nothing fits on the
devices (with or without cp): its transfers add to the step, and its time model rests on
assumptions no GPU has checked here (spmd.estimate.offload: the activations' copies hidden
behind compute); the memory it frees could buy a larger micro-batch or less recomputation,
which this order does not weigh. Params offload is not searched: the step holds the params
on the device anyway (spmd.estimate.memory.OFF_DEVICE_IN_STEP).

Without --batch every mesh gets the batch nearest --tokens-per-step / --seq-len that its
data-parallel size divides. gpipe is not searched: 1f1b has its bubble with a stash of at
most 2p - 1 inputs instead of all M. Units: bytes, seconds, FLOP/s.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any

from spmd.errors import UsageError
from spmd.estimate import cost, memory, offload, timing
from spmd.parallel.mesh import format_mesh

VIRTUAL = (2, 4)  # chunks per stage tried for the interleaved schedule


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Per-device figures of a GPU in a node of 8 with one network port per GPU: HBM in GB,
    sustained dense bf16 TFLOP/s (40-45% of the peaks in spmd.estimate.flops, what large
    training runs report), and GB/s of collective bandwidth per device inside the node
    (NVLink, as NCCL's all-reduce bus bandwidth) and between nodes (InfiniBand); for host
    offload, GB/s each way between a device and host memory (about 80% of its PCIe x16 link:
    Gen4 32 GB/s on A100, Gen5 64 GB/s on H100 / H200) and GB of host memory per node (the
    DGX systems' system memory: DGX A100 320GB 1 TB, 640GB 2 TB; DGX H100 and H200 2 TB)."""

    hbm: float
    tflops: float
    bandwidth: float
    inter_bandwidth: float
    host_bandwidth: float
    host_memory: float


GPUS = {
    "a100-40gb": Gpu(40.0, 140.0, 240.0, 25.0, host_bandwidth=25.0, host_memory=1000.0),  # HDR
    "a100-80gb": Gpu(80.0, 140.0, 240.0, 25.0, host_bandwidth=25.0, host_memory=2000.0),
    "h100": Gpu(80.0, 400.0, 400.0, 50.0, host_bandwidth=50.0, host_memory=2000.0),  # NDR 400
    "h200": Gpu(141.0, 400.0, 400.0, 50.0, host_bandwidth=50.0, host_memory=2000.0),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What a device offers: the network, sustained FLOP/s, HBM and the bytes reserved for
    the runtime, and the share of data-parallel communication that hides behind compute;
    the host memory of a node (bytes) for what --offload and --remat offload keep there."""

    net: cost.Network
    flops: float
    hbm: float
    overhead: float
    overlap: float = 0.0
    host_memory: float = math.inf

    def memory(self, s: cost.Setup) -> dict:
        """spmd.estimate.memory.memory of `s` on this cluster's devices and hosts."""
        return memory.memory(
            s, self.overhead, self.hbm, self.host_memory, self.net.devices_per_node
        )


def with_gpu(plan: Any, given: set[str]) -> Any:
    """`plan` (spmd.plan's PlanConfig) with its --gpu preset's figures for the hardware
    fields not in `given` (the flags on the command line, as field names)."""
    if not plan.gpu:
        return plan
    if plan.gpu not in GPUS:
        raise UsageError(f"--gpu {plan.gpu!r} is not one of {', '.join(GPUS)}")
    figures = dataclasses.asdict(GPUS[plan.gpu])
    return dataclasses.replace(plan, **{k: v for k, v in figures.items() if k not in given})


def cluster_of(plan: Any) -> Cluster:
    """The hardware of spmd.plan's PlanConfig `plan` (GB, GB/s, TFLOP/s) in bytes, bytes/s,
    seconds and FLOP/s."""
    net = cost.Network(
        plan.bandwidth * 1e9,
        plan.inter_bandwidth * 1e9,
        plan.latency,
        plan.devices_per_node,
        plan.host_bandwidth * 1e9,
    )
    return Cluster(
        net, plan.tflops * 1e12, plan.hbm * 1e9, plan.overhead * 1e9, plan.overlap,
        plan.host_memory * 1e9,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Space:
    """What the search may vary; a field that is not None is held fixed. `mesh` fixes the
    axes it names; `batch` 0 chooses one near `tokens` tokens per step for each mesh."""

    batch: int = 0
    tokens: int = 4 * 1024 * 1024
    mesh: dict[str, int] | None = None
    zero: int | None = None
    remat: str | None = None
    schedule: str | None = None
    virtual: int | None = None
    interleave: bool = True  # False: the executor runs no interleaved schedule (explicit)
    sequence_parallel: bool | None = None
    offload: str | None = None


@dataclasses.dataclass(frozen=True)
class Scored:
    """A candidate and what it costs: memory (spmd.estimate.memory.memory) and time
    (spmd.estimate.timing.step_time), per device and optimizer step."""

    setup: cost.Setup
    memory: dict
    time: dict

    @property
    def step_s(self) -> float:
        return self.time["step"]

    @property
    def overhead_ratio(self) -> float:
        """(exposed communication + bubble + exposed host transfers) / compute."""
        t = self.time
        return (t["exposed"] + t["bubble"] + t["host"]) / t["compute"]

    def layout(self) -> str:
        """Mesh and ZeRO stage, e.g. "pp=4,tp=8 zero 1" (+ " SP", " offload optimizer")."""
        sp = " SP" if self.setup.sequence_parallel else ""
        sp += " ulysses" if self.setup.context > 1 and self.setup.cp_mode == "ulysses" else ""
        host = f" offload {self.setup.offload}" if self.setup.offload != "none" else ""
        return f"{format_mesh(self.setup.mesh)} zero {self.setup.zero}{sp}{host}"

    def label(self) -> str:
        """The layout and how its step is cut."""
        s = self.setup
        if s.pipelined:
            chunks = f" v={s.virtual}" if s.virtual > 1 else ""
            cut = f"{s.schedule}{chunks} M={s.micro_steps}"
        else:
            cut = f"accum {s.accum}"
        return f"{self.layout()}, micro-batch {s.micro_batch}, {cut}, remat {s.remat}"


@dataclasses.dataclass(frozen=True)
class Result:
    """Fitting candidates fastest first; `considered` valid candidates in all; `smallest` the
    one needing the least memory (what to show when nothing fits)."""

    ranked: list[Scored]
    considered: int
    smallest: Scored


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(
    base: cost.Setup, devices: int, per_node: int, fixed: dict | None, contexts: tuple = (1,)
) -> Iterator[dict]:
    """Meshes of `devices` devices with tp x cp inside a node (cp one of `contexts`) and pp
    dividing the layers, holding the axes `fixed` names at their sizes."""
    fixed = fixed or {}
    for tensor in _divisors(devices):
        if tensor > per_node or per_node % tensor or fixed.get("tensor", tensor) != tensor:
            continue
        for context in contexts:
            inner = tensor * context
            if per_node % inner or devices % inner or fixed.get("context", context) != context:
                continue
            for pipeline in _divisors(devices // inner):
                if base.shape.n_layers % pipeline or fixed.get("pipeline", pipeline) != pipeline:
                    continue
                for fsdp in _divisors(devices // (inner * pipeline)):
                    rest = devices // (inner * pipeline * fsdp)
                    for expert in _expert_sizes(base.shape.n_experts, rest):
                        mesh = {"data": rest // expert, "pipeline": pipeline, "fsdp": fsdp}
                        mesh |= {"tensor": tensor, "context": context}
                        if base.shape.n_experts:  # a dense model's meshes have no expert axis
                            mesh["expert"] = expert
                        if all(mesh.get(a, 1) == size for a, size in fixed.items()):
                            yield mesh


def _expert_sizes(n_experts: int, devices: int) -> list[int]:
    """The ep sizes to try on `devices` data-parallel devices: those dividing the experts (1
    alone for a dense model). ep takes its devices from dp: it splits the batch as dp does."""
    return [e for e in _divisors(devices) if n_experts % e == 0] if n_experts else [1]


def batch_for(space: Space, seq_len: int, data_parallel: int) -> int:
    """The global batch of a mesh: --batch, or the multiple of the data-parallel size
    nearest --tokens-per-step / --seq-len (at least one sequence per replica)."""
    if space.batch:
        return space.batch
    target = max(1, round(space.tokens / seq_len))
    return max(1, round(target / data_parallel)) * data_parallel


def _cuts(s: cost.Setup, space: Space, per_replica: int) -> Iterator[dict]:
    """Ways to cut a replica's sequences into micro-batches, ascending in micro-batch size
    within each schedule: accum for pp = 1, else the schedule's M micro-batches."""
    pipeline = s.mesh["pipeline"]
    if pipeline == 1:
        for b in _divisors(per_replica):
            yield dict(accum=per_replica // b, microbatches=1, schedule="1f1b", virtual=1)
        return
    plans = [("1f1b", 1)] + [("interleaved", v) for v in VIRTUAL if space.interleave]
    if space.schedule is not None:
        wanted = space.virtual or (2 if space.schedule == "interleaved" else 1)
        plans = [(space.schedule, wanted)]
    for schedule, virtual in plans:
        for b in _divisors(per_replica):
            yield dict(accum=1, microbatches=per_replica // b, schedule=schedule, virtual=virtual)


def candidates(
    base: cost.Setup, space: Space, cluster: Cluster, contexts: tuple = (1,), host: bool = False
) -> Iterator[Scored]:
    """Every valid candidate with its memory; time only for those that fit. Within one
    (mesh, stage, SP, offload, remat, schedule), a micro-batch larger than one that does not
    fit is skipped (activations never shrink as the micro-batch grows). `host`: only the
    candidates that keep something in host memory (offload.uses_host), else only those that do
    not. `--offload params` (when given) runs under ZeRO-3 only; at fsdp = 1 as ZeRO-3 of one
    device (the engine keeps params on the host only under --zero 3)."""
    devices, per_node = base.devices, cluster.net.devices_per_node
    for mesh in meshes(base, devices, per_node, space.mesh, contexts):
        fsdp = mesh["fsdp"]
        sps = (False, True) if mesh["tensor"] > 1 else (False,)
        if space.sequence_parallel is not None:
            sps = (space.sequence_parallel,)
        for zero, sp in itertools.product((1, 2, 3) if fsdp > 1 else (0,), sps):
            if space.zero is not None and zero != (space.zero if fsdp > 1 else 0):
                continue
            data_parallel = mesh["data"] * fsdp * mesh.get("expert", 1)
            batch = batch_for(space, base.seq_len, data_parallel)
            if batch % data_parallel:
                continue
            offloads = (space.offload,) if space.offload else offload.SEARCHED_OFFLOADS
            remats = (space.remat,) if space.remat else cost.SEARCHED_REMATS
            for where, remat in itertools.product(offloads, remats):
                stage = 3 if where == "params" and fsdp == 1 else zero
                if where == "params" and stage != 3:
                    continue
                setup = dataclasses.replace(
                    base,
                    mesh=mesh,
                    zero=stage,
                    batch=batch,
                    remat=remat,
                    sequence_parallel=sp,
                    offload=where,
                )
                if offload.uses_host(setup) == host:
                    yield from _cut_candidates(setup, space, cluster)


def _cut_candidates(s: cost.Setup, space: Space, cluster: Cluster) -> Iterator[Scored]:
    too_big: set[tuple] = set()
    for cut in _cuts(s, space, s.batch // s.data_parallel):
        key = (cut["schedule"], cut["virtual"])
        if key in too_big:
            continue
        setup = dataclasses.replace(s, **cut)
        try:
            cost.check_setup(setup)
        except UsageError:
            continue
        mem = cluster.memory(setup)
        if not mem["fits"]:
            too_big.add(key)
            yield Scored(setup, mem, {})
            continue
        time = timing.step_time(setup, cluster.net, cluster.flops, cluster.overlap)
        yield Scored(setup, mem, time)


def simplicity(c: Scored) -> tuple:
    """Sort key among equally fast candidates: simpler first."""
    s = c.setup
    return (
        s.mesh["pipeline"],
        s.mesh["tensor"],
        s.context,
        s.mesh.get("expert", 1),
        s.zero,
        cost.OFFLOADS.index(s.offload),
        s.sequence_parallel,
        s.virtual,
        cost.REMATS.index(s.remat),
        sum(size > 1 for size in s.mesh.values()),
        -s.micro_batch,
        c.memory["total"],
    )


def context_sizes(base: cost.Setup, space: Space, per_node: int) -> list[tuple]:
    """The cp sizes to search, in turn until something fits: (1,) first, then every cp > 1 of
    a node that cuts the sequence into 2·cp equal chunks (the --mesh cp=N given: just N)."""
    if space.mesh and "context" in space.mesh:
        return [(space.mesh["context"],)]
    longer = tuple(c for c in _divisors(per_node)[1:] if base.seq_len % (2 * c) == 0)
    return [(1,), longer] if longer else [(1,)]


def search_passes(base: cost.Setup, space: Space, per_node: int) -> list[tuple]:
    """(host, cp sizes) to search in turn until something fits: everything on the devices
    first (without cp, then with it), then the layouts that keep something in host memory
    (--offload optimizer, --remat offload; offload.uses_host)."""
    contexts = context_sizes(base, space, per_node)
    return [(host, c) for host in (False, True) for c in contexts]


def search(base: cost.Setup, space: Space, cluster: Cluster) -> Result:
    """Rank every fitting candidate of base.devices devices for base's model. UsageError when
    no candidate is valid at all (e.g. a --batch that no data-parallel size divides)."""
    fitting, considered, smallest = [], 0, None
    for host, contexts in search_passes(base, space, cluster.net.devices_per_node):
        for c in candidates(base, space, cluster, contexts, host):
            considered += 1
            if c.memory["fits"]:
                fitting.append(c)
            elif smallest is None or c.memory["total"] < smallest.memory["total"]:
                smallest = c
        if fitting:
            break
    if not considered:
        raise UsageError(
            f"--recommend found no valid layout of {base.devices} devices for --batch "
            f"{space.batch}; use a batch that more data-parallel sizes divide (or leave it out)"
        )
    fitting.sort(key=lambda c: (float(f"{c.step_s / c.setup.batch:.3g}"), simplicity(c)))
    if fitting:
        smallest = min(fitting, key=lambda c: c.memory["total"])
    assert smallest is not None  # something was considered: it fits, or it is the smallest
    return Result(fitting, considered, smallest)


def distinct_layouts(ranked: list[Scored], count: int) -> list[Scored]:
    """The best candidate of each of the first `count` distinct structures: tp, pp, cp and ep
    sizes, ZeRO stage and --offload (how dp and fsdp split the rest is a detail of each)."""
    seen: set[tuple] = set()
    out = []
    for c in ranked:
        s = c.setup
        key: tuple = (s.mesh["tensor"], s.mesh["pipeline"], s.context, s.zero, s.offload)
        key += (s.mesh.get("expert", 1),)
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == count:
            break
    return out
