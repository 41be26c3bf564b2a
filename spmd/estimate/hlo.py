"""Read a compiled jitted step: which collectives it runs and how much memory it needs per device.

Works on the optimized HLO text of ``jax.jit(f).lower(...).compile()`` (``compiled.as_text()``).
All byte counts are per device. Replica-group ids in an SPMD program are partition ids, i.e.
positions in ``mesh.devices.flat``; they are mapped to mesh axis names with that assumption.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from spmd.estimate import units

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


def collectives(compiled: Any, mesh: jax.sharding.Mesh | None = None) -> list[Collective]:
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
        text = compiled.as_text()
    partitions, replicas = _header_int(text, "num_partitions"), _header_int(text, "replica_count")
    comps, entry = _parse_computations(text)
    mult = _multipliers(comps, entry)
    out = []
    for comp, instrs in comps.items():
        for name, shape, opcode, attrs in instrs:
            if opcode not in _OPCODES or mult.get(comp, 0) == 0:
                continue
            cross_replica = "channel_id=" not in attrs and "use_global_device_ids=true" not in attrs
            default_size = replicas if cross_replica else partitions
            groups = _replica_groups(attrs, default_size)
            if groups is not None and all(len(set(g)) <= 1 for g in groups):
                continue
            if opcode in _OUTPUT_IN_ELEMENT_1 and len(_tuple_elements(shape)) > 1:
                shape = _tuple_elements(shape)[1]
            leaves = re.findall(r"([a-z][a-z0-9]*)\[([^\]]*)\]", shape)
            dtypes = sorted({dt for dt, _ in leaves})
            out.append(
                Collective(
                    kind=_OPCODES[opcode],
                    bytes=sum(_nbytes(dt, dims) for dt, dims in leaves),
                    count=mult[comp],
                    axes=_axes(groups, mesh),
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


def fingerprint(compiled: Any) -> str:
    """16 hex digits of the compiled module's text without its source locations, names
    renumbered in order of appearance (the numbers XLA gives depend on what was traced before
    in the process): two compilations of the same step (same ops, shardings, collectives and
    schedule) from two commands get the same fingerprint."""
    numbers: dict[str, int] = {}

    def renumber(match: re.Match) -> str:
        return f"{match.group(1)}.{numbers.setdefault(match.group(0), len(numbers))}"

    text = "\n".join(_NUMBERED.sub(renumber, line) for line in _without_locations(compiled))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_locations(compiled: Any) -> list[str]:
    """The lines of the compiled module's text, source-location tables and metadata dropped."""
    kept, skipping = [], False
    for line in compiled.as_text().splitlines():
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


def dot_dtypes(compiled: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(result element type, operand element types) of every dot instruction, e.g.
    ("f32", ("bf16", "bf16")): which precision the matmuls run in. Takes a Compiled, a
    Lowered (read as its pre-optimization HLO) or HLO text."""
    if hasattr(compiled, "compile"):
        compiled = compiled.as_text(dialect="hlo")
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps, _ = _parse_computations(text)
    out = []
    for instrs in comps.values():
        shapes = {name: shape for name, shape, _, _ in instrs}
        for _, shape, opcode, attrs in instrs:
            if opcode != "dot":
                continue
            args = _tuple_elements(_balanced(attrs, attrs.index("(")))
            operands = tuple(_element_type(shapes.get(a.lstrip("%"), a)) for a in args)
            out.append((_element_type(shape), operands))
    return out


def _element_type(shape: str) -> str:
    """ "bf16" of "bf16[8,4]{1,0}" or of a typed operand "bf16[8,4]{1,0} %x"; "" if unknown."""
    m = re.match(r"\s*([a-z][a-z0-9]*)\[", shape)
    return m.group(1) if m else ""


def memory(compiled: Any) -> dict[str, int]:
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


def _parse_computations(text: str) -> tuple[dict[str, list[tuple]], str | None]:
    """computation name -> [(instr name, result shape, opcode, attribute text)], entry name."""
    text = re.sub(r"/\*.*?\*/", "", text)  # e.g. /*index=5*/ inside long tuples
    comps: dict[str, list[tuple]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            if not line.startswith("HloModule"):
                current = re.match(r"(?:ENTRY\s+)?%?([^\s(]+)", line).group(1)
                comps[current] = []
                entry = current if line.startswith("ENTRY") else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = re.match(r"\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$", line)
        if current is None or m is None:
            continue
        rest = m.group(2)
        shape = _balanced(rest, 0) if rest.startswith("(") else rest.split()[0]
        op = re.match(r"\s*([a-z][\w\-]*)\(", rest[len(shape) :])
        if op:
            comps[current].append((m.group(1), shape, op.group(1), rest[len(shape) :]))
    return comps, entry


def _multipliers(comps: dict[str, list[tuple]], entry: str | None) -> dict[str, int]:
    """How many times each computation runs per step, following calls from ENTRY."""
    if entry is None:
        return dict.fromkeys(comps, 1)
    callers: dict[str, list[tuple[str, int]]] = {}
    for comp, instrs in comps.items():
        for _, _, opcode, attrs in instrs:
            if opcode.endswith(("-done", "-update")):
                continue  # they name the same computation as their -start
            trip = re.search(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)', attrs)
            factor = int(trip.group(1)) if opcode == "while" and trip else 1
            attrs = re.sub(r'"(?:[^"\\]|\\.)*"', '""', attrs)
            single = r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
            called = re.findall(single + r"=%?([\w.\-]+)", attrs)
            for group in re.findall(
                r"\b(?:branch_computations|called_computations|calls)=\{([^}]*)\}", attrs
            ):
                called += re.findall(r"%?([\w.\-]+)", group)
            for callee in called:
                callers.setdefault(callee, []).append((comp, factor))
    memo: dict[str, int] = {entry: 1}

    def mult(comp: str) -> int:
        if comp not in memo:
            memo[comp] = 0  # guards against cycles, which valid HLO does not have
            memo[comp] = sum(mult(caller) * f for caller, f in callers.get(comp, []))
        return memo[comp]

    return {comp: mult(comp) for comp in comps}


def _replica_groups(attrs: str, default_size: int) -> list[list[int]] | None:
    """Device-id groups of a collective; None when they cannot be read."""
    attrs = re.sub(r'"(?:[^"\\]|\\.)*"', '""', attrs)
    pairs = re.search(r"\bsource_target_pairs=(?=\{)", attrs)
    if pairs:
        body = _balanced(attrs, pairs.end())
        return [[int(i) for i in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", body)]
    m = re.search(r"\breplica_groups=", attrs)
    if m is None:
        return [list(range(default_size))]
    spec = attrs[m.end() :]
    if spec.startswith("{"):
        body = _balanced(spec, 0)
        groups = [
            [int(i) for i in re.findall(r"\d+", g)] for g in re.findall(r"\{[\d,\s]*\}", body[1:-1])
        ]
        return groups or [list(range(default_size))]
    iota = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if iota:
        return _iota(iota.group(3), iota.group(4)).reshape(int(iota.group(1)), -1).tolist()
    mesh = re.match(r"mesh\[([^\]]*)\]", spec)
    if mesh:
        return _mesh_axes_groups(mesh.group(1), spec[mesh.end() :])
    return None


def _mesh_axes_groups(mesh_spec: str, rest: str) -> list[list[int]] | None:
    """Groups of the mesh-axes form: mesh['axis_0'=4,'axis_1'=2], device_ids=(...) {'axis_0'}."""
    sizes = [int(s) for s in re.findall(r"=(\d+)", mesh_spec)]
    names = re.findall(r"'?([^',=\s]+)'?=\d+", mesh_spec)
    n = math.prod(sizes)
    devices = np.arange(n)
    ids = re.match(r",\s*device_ids=(?=\()", rest)
    if ids:
        dev_spec = _balanced(rest, ids.end())[1:-1]
        rest = rest[ids.end() + len(dev_spec) + 2 :]
        iota = re.fullmatch(r"(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", dev_spec.strip())
        devices = (
            _iota(iota.group(1), iota.group(2))
            if iota
            else np.array([int(i) for i in re.findall(r"\d+", dev_spec)][-n:])
        )
    axes = re.match(r"\s*\{([^}]*)\}", rest)
    if axes is None or devices.size != n:
        return None
    refs: dict[int, list[tuple[int, int]]] = {}
    for ref in re.finditer(r"'?([^',:\s]+)'?(?::\((\d+)\)(\d+))?", axes.group(1)):
        if ref.group(1) not in names:
            return None
        dim = names.index(ref.group(1))
        pre, size = (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else (1, sizes[dim])
        refs.setdefault(dim, []).append((pre, size))
    new_dims, grouped = [], []
    for dim, full in enumerate(sizes):
        prefix = 1
        for pre, size in sorted(refs.get(dim, [])):
            if pre != prefix:
                new_dims.append(pre // prefix)
                prefix = pre
            grouped.append(len(new_dims))
            new_dims.append(size)
            prefix *= size
        if prefix != full:
            new_dims.append(full // prefix)
    perm = [d for d in range(len(new_dims)) if d not in grouped] + grouped
    group_size = math.prod(new_dims[d] for d in grouped)
    return devices.reshape(new_dims).transpose(perm).reshape(-1, group_size).tolist()


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """Flat device ids of arange(prod(dims)).reshape(dims).transpose(perm)."""
    shape = [int(d) for d in dims.split(",")]
    arr = np.arange(math.prod(shape)).reshape(shape)
    return (arr.transpose([int(p) for p in perm.split(",")]) if perm else arr).ravel()


def _axes(groups: list[list[int]] | None, mesh: jax.sharding.Mesh | None) -> tuple[str, ...]:
    """Mesh axis names whose coordinate varies inside some group (ids = mesh.devices.flat order)."""
    if mesh is None or not groups:
        return ()
    names = tuple(mesh.axis_names)
    dims = tuple(mesh.shape[a] for a in names)
    if any(i < 0 or i >= math.prod(dims) for g in groups for i in g):
        return ()
    varying = np.zeros(len(dims), dtype=bool)
    for group in groups:
        coords = np.array(np.unravel_index(group, dims))  # (ndim, len(group))
        varying |= (coords != coords[:, :1]).any(axis=1)
    return tuple(n for n, v in zip(names, varying, strict=True) if v)


def _nbytes(dtype: str, dims: str) -> int:
    """Bytes of one array shape, e.g. ("bf16", "8,4") -> 64. token/opaque -> 0."""
    m = re.match(r"[a-z]+?(\d+)", dtype)
    bits = 8 if dtype == "pred" else int(m.group(1)) if m else 0
    sizes = [int(d.lstrip("<=")) for d in dims.split(",") if d.strip()]
    return (math.prod(sizes) * bits + 7) // 8


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape "(a, (b, c), d)" -> ["a", "(b, c)", "d"]."""
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape[1:-1], start=1):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(shape[start:i].strip())
            start = i + 1
    parts.append(shape[start:-1].strip())
    return parts


def _balanced(text: str, start: int) -> str:
    """The bracketed span of ``text`` opening at ``start`` (any of ([{ nest), brackets included."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return text[start : i + 1]
    return text[start:]


def _header_int(text: str, key: str) -> int:
    """An integer attribute of the HloModule header line, 1 when absent."""
    m = re.search(rf"^HloModule.*\b{key}=(\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else 1


def instructions(compiled: Any) -> list[tuple[str, str, str, str, str, int]]:
    """Every instruction of ``compiled`` (a jax Compiled object or its HLO text) as
    (computation, name, result shape, opcode, attribute text, executions per step), the last
    being the product of the known trip counts of the while loops around it (0: never called)."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps, entry = _parse_computations(text)
    mult = _multipliers(comps, entry)
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
