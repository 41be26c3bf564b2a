"""Read a compiled jitted step: which collectives it runs and how much memory it needs per device.

Works on the optimized HLO text of ``jax.jit(f).lower(...).compile()`` (``compiled.as_text()``).
All byte counts are per device. Replica-group ids in an SPMD program are partition ids, i.e.
positions in ``mesh.devices.flat``; they are mapped to mesh axis names with that assumption.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from spmd.estimate import hlo_text, units

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyCompiled

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_OPCODES = {k: k for k in KINDS} | {
    "all-reduce-start": "all-reduce",
    "all-gather-start": "all-gather",
    "collective-permute-start": "collective-permute",
    "ragged-all-to-all": "all-to-all",
}
# Async starts whose result is (operand, output, ...): only tuple element 1 is the output.
_OUTPUT_IN_ELEMENT_1 = ("all-gather-start", "collective-permute-start")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program."""

    kind: str  # one of KINDS
    bytes: int  # bytes of the op's result on one device, for one execution
    count: int  # executions per step: product of known trip counts of enclosing while loops
    axes: tuple[str, ...]  # mesh axes varying inside a replica group; () if unknown
    dtype: str  # HLO element type of the result, e.g. "f32" ("bf16,f32" if mixed)
    name: str  # HLO instruction name


def optimized_text(compiled: AnyCompiled) -> str:
    """The optimized HLO text of a compiled program. jax types it `str | None`; XLA gives the
    text of every program spmd compiles, so None is an error here, not a silent empty text."""
    text = compiled.as_text()
    if text is None:
        raise RuntimeError("the compiled program has no HLO text (jax.stages.Compiled.as_text)")
    return text


def collectives(
    compiled: AnyCompiled | jax.stages.Lowered | str, mesh: jax.sharding.Mesh | None = None
) -> list[Collective]:
    """Collectives of ``compiled`` (a jax Compiled object or its HLO text; or a Lowered one: the
    program as spmd emits it, before XLA optimizes it), in HLO text order. XLA:CPU promotes
    16-bit collectives to fp32 when it compiles; the lowered program shows the emitted dtype.

    Ops whose replica groups all hold a single device are left out. With ``mesh`` None, axes=().
    """
    if isinstance(compiled, str):
        text = compiled
    elif isinstance(compiled, jax.stages.Lowered):
        text = compiled.as_text(dialect="hlo")
    else:
        text = optimized_text(compiled)
    partitions = hlo_text.header_int(text, "num_partitions")
    replicas = hlo_text.header_int(text, "replica_count")
    comps, entry = hlo_text.parse_computations(text)
    mult = hlo_text.multipliers(comps, entry)
    out = []
    for comp, instrs in comps.items():
        for name, shape, opcode, attrs in instrs:
            if opcode not in _OPCODES or mult.get(comp, 0) == 0:
                continue
            cross_replica = "channel_id=" not in attrs and "use_global_device_ids=true" not in attrs
            default_size = replicas if cross_replica else partitions
            groups = hlo_text.replica_groups(attrs, default_size)
            if groups is not None and all(len(set(g)) <= 1 for g in groups):
                continue
            if opcode in _OUTPUT_IN_ELEMENT_1 and len(hlo_text.tuple_elements(shape)) > 1:
                shape = hlo_text.tuple_elements(shape)[1]
            leaves = re.findall(r"([a-z][a-z0-9]*)\[([^\]]*)\]", shape)
            dtypes = sorted({dt for dt, _ in leaves})
            out.append(
                Collective(
                    kind=_OPCODES[opcode],
                    bytes=sum(hlo_text.nbytes(dt, dims) for dt, dims in leaves),
                    count=mult[comp],
                    axes=hlo_text.varying_axes(groups, mesh),
                    dtype=",".join(dtypes),
                    name=name,
                )
            )
    return out


# Tables of source locations at the top of a module's text, and each instruction's metadata:
# where in Python an op was written, which says nothing about what the step computes.
_LOCATION_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_METADATA = re.compile(r",? metadata=\{[^}]*\}")


# An instruction or computation name with XLA's numeric suffixes, e.g. %mul.2128, region_19.17.
_NUMBERED = re.compile(r"\b([A-Za-z_][A-Za-z0-9_\-]*)((?:\.(?:[0-9]+|clone))+)\b")


def fingerprint(compiled: AnyCompiled) -> str:
    """16 hex digits of the compiled module's text without its source locations, names
    renumbered in order of appearance (the numbers XLA gives depend on what was traced before
    in the process): two compilations of the same step (same ops, shardings, collectives and
    schedule) from two commands get the same fingerprint."""
    numbers: dict[str, int] = {}

    def renumber(match: re.Match) -> str:
        return f"{match.group(1)}.{numbers.setdefault(match.group(0), len(numbers))}"

    text = "\n".join(_NUMBERED.sub(renumber, line) for line in _without_locations(compiled))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_locations(compiled: AnyCompiled) -> list[str]:
    """The lines of the compiled module's text, source-location tables and metadata dropped."""
    kept, skipping = [], False
    for line in optimized_text(compiled).splitlines():
        if line.strip() in _LOCATION_TABLES:
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            kept.append(_METADATA.sub("", line))
    return kept


def collective_summary(colls: list[Collective]) -> dict[str, dict]:
    """Per kind: {"count": executions per step, "bytes": per-device bytes per step (sum of
    bytes*count), "axes": sorted distinct axis groups as "data+fsdp" strings}."""
    summary: dict[str, dict] = {}
    for kind in KINDS:
        these = [c for c in colls if c.kind == kind]
        if these:
            summary[kind] = {
                "count": sum(c.count for c in these),
                "bytes": sum(c.bytes * c.count for c in these),
                "axes": sorted({"+".join(c.axes) for c in these}),
            }
    return summary


def dot_dtypes(
    compiled: AnyCompiled | jax.stages.Lowered | str,
) -> list[tuple[str, tuple[str, ...]]]:
    """(result element type, operand element types) of every dot instruction, e.g.
    ("f32", ("bf16", "bf16")): which precision the matmuls run in. Takes a Compiled, a
    Lowered (read as its pre-optimization HLO) or HLO text."""
    if isinstance(compiled, jax.stages.Lowered):
        compiled = compiled.as_text(dialect="hlo")
    text = compiled if isinstance(compiled, str) else optimized_text(compiled)
    comps, _ = hlo_text.parse_computations(text)
    out = []
    for instrs in comps.values():
        shapes = {name: shape for name, shape, _, _ in instrs}
        for _, shape, opcode, attrs in instrs:
            if opcode != "dot":
                continue
            args = hlo_text.tuple_elements(hlo_text.balanced(attrs, attrs.index("(")))
            operands = tuple(hlo_text.element_type(shapes.get(a.lstrip("%"), a)) for a in args)
            out.append((hlo_text.element_type(shape), operands))
    return out


def memory(compiled: AnyCompiled) -> dict[str, int]:
    """Per-device bytes from ``compiled.memory_analysis()``: argument, output, temp,
    generated_code, alias, and peak_estimate = argument + output + temp - alias; host_argument,
    host_output and host_temp where the backend reports host memory apart (non-zero).
    Fields the backend does not report are omitted."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    out = {}
    for key in ("argument", "output", "temp", "generated_code", "alias"):
        value = getattr(stats, f"{key}_size_in_bytes", None)
        if value is not None:
            out[key] = int(value)
    for key in ("argument", "output", "temp"):  # host memory, where the backend counts it apart
        value = getattr(stats, f"host_{key}_size_in_bytes", None)
        if value:
            out[f"host_{key}"] = int(value)
    if all(k in out for k in ("argument", "output", "temp")):
        out["peak_estimate"] = out["argument"] + out["output"] + out["temp"] - out.get("alias", 0)
    return out


def format_report(summary: dict, mem: dict) -> str:
    """Human readable table of ``collective_summary`` and ``memory`` output (bytes per device)."""
    lines = [f"{'collective':<20}{'count':>8}{'bytes/step':>14}  axes"]
    for kind, row in summary.items():
        axes = ", ".join(a or "?" for a in row["axes"])
        lines.append(f"{kind:<20}{row['count']:>8}{units.binary(row['bytes']):>14}  {axes}")
    lines.append(f"{'memory per device':<20}{'':>8}{'bytes':>14}")
    for key, value in mem.items():
        lines.append(f"{key:<20}{'':>8}{units.binary(value):>14}")
    return "\n".join(lines)


def instructions(compiled: AnyCompiled | str) -> list[tuple[str, str, str, str, str, int]]:
    """Every instruction of ``compiled`` (a jax Compiled object or its HLO text) as
    (computation, name, result shape, opcode, attribute text, executions per step), the last
    being the product of the known trip counts of the while loops around it (0: never called)."""
    text = compiled if isinstance(compiled, str) else optimized_text(compiled)
    comps, entry = hlo_text.parse_computations(text)
    mult = hlo_text.multipliers(comps, entry)
    return [
        (comp, name, shape, opcode, attrs, mult.get(comp, 0))
        for comp, instrs in comps.items()
        for name, shape, opcode, attrs in instrs
    ]


def grad_reductions(colls: list[Collective]) -> list[Collective]:
    """The all-reduces and reduce-scatters that run once per step (outside loops) on more than
    a scalar (the loss and norm psums): the gradient reductions, one per bucket with buckets."""
    return [
        c
        for c in colls
        if c.kind in ("all-reduce", "reduce-scatter") and c.count == 1 and c.bytes > 8
    ]


def format_grad_reductions(colls: list[Collective]) -> str:
    """The step's gradient reductions (all-reduces and reduce-scatters that run once per step
    on more than a scalar), per kind and axes: how many and their sizes per device, e.g.
    "all-reduce over data: 5 (256.00 KiB x4, 66.25 KiB)". With --bucket-mb these are the
    buckets."""
    groups: dict[str, list[int]] = {}
    for c in grad_reductions(colls):
        groups.setdefault(f"{c.kind} over {'+'.join(c.axes) or '?'}", []).append(c.bytes)
    lines = []
    for what, sizes in groups.items():
        runs: list[list[int]] = []
        for size in sizes:  # consecutive equal sizes shown once, with a count
            if runs and runs[-1][0] == size:
                runs[-1][1] += 1
            else:
                runs.append([size, 1])
        shown = ", ".join(units.binary(s) + (f" x{n}" if n > 1 else "") for s, n in runs)
        lines.append(f"  {what}: {len(sizes)} ({shown}; {units.binary(sum(sizes))} in all)")
    return "gradient reductions per step (one each per bucket):\n" + (
        "\n".join(lines) or "  none outside the layer loop"
    )
