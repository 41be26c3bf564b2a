"""Read XLA's HLO text: its computations and their instructions, how many times each runs per
step, the device groups of a collective and the bytes of a shape. `spmd.estimate.hlo` builds
on it to say what a compiled step communicates and holds."""

from __future__ import annotations

import math
import re

import jax
import numpy as np


def parse_computations(text: str) -> tuple[dict[str, list[tuple]], str | None]:
    """computation name -> [(instr name, result shape, opcode, attribute text)], entry name."""
    text = re.sub(r"/\*.*?\*/", "", text)  # e.g. /*index=5*/ inside long tuples
    comps: dict[str, list[tuple]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            if not line.startswith("HloModule"):
                header = re.match(r"(?:ENTRY\s+)?%?([^\s(]+)", line)
                assert header, line  # the pattern matches any line that starts with a non-space
                current = header.group(1)
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
        shape = balanced(rest, 0) if rest.startswith("(") else rest.split()[0]
        op = re.match(r"\s*([a-z][\w\-]*)\(", rest[len(shape) :])
        if op:
            comps[current].append((m.group(1), shape, op.group(1), rest[len(shape) :]))
    return comps, entry


def _counted_trips(comps: dict[str, list[tuple]], attrs: str) -> int:
    """Trips of a while loop whose condition is `counter < N` for an integer constant N (a
    lax.scan as jax lowers it, counting from 0), or 1 when the condition is anything else."""
    cond = re.search(r"\bcondition=%?([\w.\-]+)", attrs)
    instrs = comps.get(cond.group(1), []) if cond else []
    constants = {
        name: int(value.group(1))
        for name, shape, opcode, args in instrs
        if opcode == "constant"
        and shape.startswith("s32[]")
        and (value := re.search(r"constant\((\d+)\)", args))
    }
    for _, _, opcode, args in instrs:
        if opcode == "compare" and "direction=LT" in args:
            operands = re.findall(r"%?([\w.\-]+)[,)]", args.split("compare(", 1)[-1])
            if len(operands) >= 2 and operands[1] in constants:
                return constants[operands[1]]
    return 1


def multipliers(comps: dict[str, list[tuple]], entry: str | None) -> dict[str, int]:
    """How many times each computation runs per step, following calls from ENTRY (each branch
    of a conditional as often as the conditional)."""
    return {comp: int(n) for comp, n in _multipliers(comps, entry, share_branches=False).items()}


def expected_multipliers(comps: dict[str, list[tuple]], entry: str | None) -> dict[str, float]:
    """`multipliers` with the n branches of a conditional sharing its executions, 1/n each
    (which one runs is data: Gemma's attention kernel for local and global layers)."""
    return _multipliers(comps, entry, share_branches=True)


def _multipliers(
    comps: dict[str, list[tuple]], entry: str | None, share_branches: bool
) -> dict[str, float]:
    if entry is None:
        return dict.fromkeys(comps, 1.0)
    callers: dict[str, list[tuple[str, float]]] = {}
    for comp, instrs in comps.items():
        for _, _, opcode, attrs in instrs:
            if opcode.endswith(("-done", "-update")):
                continue  # they name the same computation as their -start
            trip = re.search(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)', attrs)
            factor: float = int(trip.group(1)) if opcode == "while" and trip else 1
            if opcode == "while" and not trip:  # a lowered program: no backend config yet
                factor = _counted_trips(comps, attrs)
            attrs = re.sub(r'"(?:[^"\\]|\\.)*"', '""', attrs)
            single = r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
            called = re.findall(single + r"=%?([\w.\-]+)", attrs)
            for group in re.findall(
                r"\b(?:branch_computations|called_computations|calls)=\{([^}]*)\}", attrs
            ):
                called += re.findall(r"%?([\w.\-]+)", group)
            if opcode == "conditional" and share_branches:
                factor /= max(len(set(called)), 1)
            for callee in called:
                callers.setdefault(callee, []).append((comp, factor))
    memo: dict[str, float] = {entry: 1}

    def mult(comp: str) -> float:
        if comp not in memo:
            memo[comp] = 0  # guards against cycles, which valid HLO does not have
            memo[comp] = sum(mult(caller) * f for caller, f in callers.get(comp, []))
        return memo[comp]

    return {comp: mult(comp) for comp in comps}


def header_int(text: str, key: str) -> int:
    """An integer attribute of the HloModule header line, 1 when absent."""
    m = re.search(rf"^HloModule.*\b{key}=(\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else 1


def replica_groups(attrs: str, default_size: int) -> list[list[int]] | None:
    """Device-id groups of a collective; None when they cannot be read."""
    attrs = re.sub(r'"(?:[^"\\]|\\.)*"', '""', attrs)
    pairs = re.search(r"\bsource_target_pairs=(?=\{)", attrs)
    if pairs:
        body = balanced(attrs, pairs.end())
        return [[int(i) for i in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", body)]
    m = re.search(r"\breplica_groups=", attrs)
    if m is None:
        return [list(range(default_size))]
    spec = attrs[m.end() :]
    if spec.startswith("{"):
        body = balanced(spec, 0)
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
        dev_spec = balanced(rest, ids.end())[1:-1]
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


def varying_axes(groups: list[list[int]] | None, mesh: jax.sharding.Mesh | None) -> tuple[str, ...]:
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


def element_type(shape: str) -> str:
    """ "bf16" of "bf16[8,4]{1,0}" or of a typed operand "bf16[8,4]{1,0} %x"; "" if unknown."""
    m = re.match(r"\s*([a-z][a-z0-9]*)\[", shape)
    return m.group(1) if m else ""


def nbytes(dtype: str, dims: str) -> int:
    """Bytes of one array shape, e.g. ("bf16", "8,4") -> 64. token/opaque -> 0."""
    m = re.match(r"[a-z]+?(\d+)", dtype)
    bits = 8 if dtype == "pred" else int(m.group(1)) if m else 0
    sizes = [int(d.lstrip("<=")) for d in dims.split(",") if d.strip()]
    return (math.prod(sizes) * bits + 7) // 8


def tuple_elements(shape: str) -> list[str]:
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


def balanced(text: str, start: int) -> str:
    """The bracketed span of ``text`` opening at ``start`` (any of ([{ nest), brackets included."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return text[start : i + 1]
    return text[start:]
