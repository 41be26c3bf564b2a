"""`--profile START:STOP`: trace those train steps and say where their time went, per device.

jax.profiler writes the trace (`plugins/profile/<run>/<host>.xplane.pb`, which TensorBoard's
profile plugin and Perfetto show; `perfetto_trace.json.gz` beside it). jaxlib's own
`jax.profiler.ProfileData` reads the xplane back. Splitting a device's time into compute, each
collective kind and idle is done here: xprof (the TensorBoard profile plugin, a large optional
package) summarises per-op time on GPU/TPU device planes, but nothing installed with jax does,
and on CPU the XLA ops are host-thread events that only their `device_ordinal` stat ties to a
device.

What a trace holds (verified on XLA:CPU, jax 0.10.2): one event per executed HLO instruction,
with stats `hlo_op` (the instruction name, e.g. "all-reduce.58"), `hlo_module`
("jit_train_step") and `device_ordinal`; a collective's event lasts from its call to its
completion, waiting for the slowest peer included; the ops of one device run on several
threads at once, and a `while` event spans its body's ops. On GPU/TPU the events sit on the
device's own plane ("/device:GPU:0"), which then names the device (not verified here).

Accounting, per device, over the window from its first to its last traced op of the module:
an instant is compute if any non-collective op runs, else communication (shared equally by the
collective kinds running), else idle (host stalls between steps included). Communication that
overlaps compute is therefore hidden: it is reported apart ("hidden"), beside the exposed total,
and the communication fraction is the exposed share.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from jax.profiler import ProfileData

from spmd.errors import UsageError
from spmd.estimate import hlo

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyCompiled

CONTROL_FLOW = ("while", "conditional", "call")  # their events span the ops they run


def parse_window(spec: str, steps: int) -> tuple[int, int]:
    """ "START:STOP" -> (START, STOP), 1-based inclusive optimizer steps within 1..steps."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if m is None or not 1 <= int(m.group(1)) <= int(m.group(2)) <= steps:
        raise UsageError(
            f"--profile {spec!r} must be START:STOP with 1 <= START <= STOP <= --steps {steps}"
        )
    return int(m.group(1)), int(m.group(2))


def op_category(hlo_op: str) -> str:
    """The collective kind of an HLO instruction name (hlo.KINDS; async -start/-done halves
    count as their collective), "control" for control flow, else "compute"."""
    base = re.sub(r"\.\d+$", "", hlo_op)
    base = re.sub(r"-(start|done|update)$", "", base)
    base = "all-to-all" if base == "ragged-all-to-all" else base
    if base in hlo.KINDS:
        return base
    return "control" if base in CONTROL_FLOW else "compute"


@dataclasses.dataclass(frozen=True)
class OpEvent:
    device: str  # "0", "1", ... (CPU device ordinal) or a device plane name
    start_ns: float
    end_ns: float
    hlo_op: str
    module: str


def read_trace(trace_dir: str | Path) -> list[OpEvent]:
    """The HLO-op events of the newest xplane.pb under `trace_dir` (empty if there is none)."""

    files = sorted(Path(trace_dir).glob("plugins/profile/*/*.xplane.pb"))
    if not files:
        return []
    events = []
    for plane in ProfileData.from_file(str(files[-1])).planes:
        plane_device = plane.name if plane.name.startswith("/device:") else None
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                device = stats.get("device_ordinal", plane_device)
                if "hlo_op" not in stats or device is None:
                    continue
                events.append(
                    OpEvent(
                        str(device),
                        event.start_ns,
                        event.end_ns,
                        str(stats["hlo_op"]),
                        str(stats.get("hlo_module", "")),
                    )
                )
    return events


def breakdown(events: list[OpEvent], module: str, steps: int) -> dict[str, dict[str, float]]:
    """Per device: seconds per step in "compute", each collective kind of hlo.KINDS (exposed:
    no compute ran meanwhile), "idle", their sum "step", "exposed_comm" (the kinds' sum),
    "hidden_comm" (seconds a collective ran while compute ran too: overlapped), and
    "comm_fraction" (exposed collective seconds / step seconds).

    Only events of `module` (e.g. "jit_train_step") count; `steps` is how many executions of
    it the trace holds."""
    per_device: dict[str, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.module == module or e.module.startswith(module + "("):
            per_device.setdefault(e.device, []).append(
                (e.start_ns, e.end_ns, op_category(e.hlo_op))
            )
    table = {}
    for device in sorted(per_device, key=_natural):
        seconds = _sweep(per_device[device])
        hidden = seconds.pop("hidden_comm") / steps / 1e9
        row = {k: v / steps / 1e9 for k, v in seconds.items()}
        row["step"] = sum(row.values())
        comm = sum(row[k] for k in hlo.KINDS)
        row["exposed_comm"], row["hidden_comm"] = comm, hidden
        row["comm_fraction"] = comm / row["step"] if row["step"] > 0 else 0.0
        table[device] = row
    return table


def _sweep(intervals: list[tuple[float, float, str]]) -> dict[str, float]:
    """Nanoseconds of compute / each collective / idle between the first start and last end,
    which add up to that span, and "hidden_comm": the nanoseconds during which a collective ran
    beside compute (counted as compute above)."""
    boundaries = []
    for start, end, category in intervals:
        if category != "control":
            boundaries += [(start, 1, category), (end, -1, category)]
    boundaries.sort(key=lambda b: (b[0], b[1]))
    totals = dict.fromkeys(("compute", *hlo.KINDS, "idle", "hidden_comm"), 0.0)
    active: dict[str, int] = {}
    first = min(start for start, _, _ in intervals)
    last = max(end for _, end, _ in intervals)
    previous = first
    for at, delta, category in [*boundaries, (last, 0, "")]:
        span = at - previous
        if span > 0:
            running = [k for k, n in active.items() if n > 0]
            if "compute" in running:
                totals["compute"] += span
                if len(running) > 1:  # a collective ran beside it: hidden by the overlap
                    totals["hidden_comm"] += span
            elif running:
                for kind in running:
                    totals[kind] += span / len(running)
            else:
                totals["idle"] += span
            previous = at
        if delta:
            active[category] = active.get(category, 0) + delta
    return totals


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def mean_row(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """The average device: each column averaged over the devices."""
    keys = next(iter(table.values())).keys()
    return {k: sum(row[k] for row in table.values()) / len(table) for k in keys}


def format_breakdown(table: dict[str, dict[str, float]]) -> str:
    """A table of milliseconds per step per device and the mean: compute, the exposed time of
    each collective kind, idle; then communication exposed and hidden behind compute, and the
    exposed share of the step."""
    short = {"reduce-scatter": "red-scatter", "collective-permute": "coll-permute"}
    widths = {"step": 9, "compute": 9, **dict.fromkeys(hlo.KINDS, 13), "idle": 9}
    widths |= {"exposed_comm": 9, "hidden_comm": 9}
    short |= {"exposed_comm": "exposed", "hidden_comm": "hidden"}
    header = f"{'device':<8}" + "".join(f"{short.get(c, c):>{w}}" for c, w in widths.items())
    lines = [f"{'ms per step':<8}", header + f"{'comm':>8}"]
    for name, row in [*table.items(), ("mean", mean_row(table))]:
        cells = "".join(f"{row[c] * 1e3:>{w}.2f}" for c, w in widths.items())
        lines.append(f"{name:<8}{cells}{row['comm_fraction']:>8.1%}")
    return "\n".join(lines)


def module_name(compiled: AnyCompiled | str) -> str:
    """The HLO module name of a compiled step (what the trace's hlo_module stat says)."""
    text = compiled if isinstance(compiled, str) else hlo.optimized_text(compiled)
    m = re.match(r"HloModule ([^\s,]+)", text)
    return m.group(1) if m else ""


class StepProfiler:
    """Starts a trace before step START is dispatched and stops it after step STOP finished;
    the device is drained at both ends so the trace holds exactly those steps. A run resumed
    inside the window is traced from its first step; one resumed after it is not traced."""

    def __init__(self, window: tuple[int, int], trace_dir: str, module: str) -> None:
        self.window, self.trace_dir, self.module = window, trace_dir, module
        self.first_traced: int | None = None  # the step the trace started at

    def before_step(self, step: int, in_flight: Any) -> float:
        """Start tracing before the window's first step; return the seconds spent starting."""

        start, stop = self.window
        if self.first_traced is not None or not start <= step <= stop:
            return 0.0
        jax.block_until_ready(in_flight)
        started = time.perf_counter()
        jax.profiler.start_trace(self.trace_dir, create_perfetto_trace=True)
        self.first_traced = step
        return time.perf_counter() - started

    def after_step(self, step: int, outputs: Any) -> tuple[dict | None, float]:
        """After step STOP: (the breakdown table, seconds spent stopping and reading the
        trace); (None, 0.0) at other steps."""

        if step != self.window[1] or self.first_traced is None:
            return None, 0.0
        jax.block_until_ready(outputs)
        started = time.perf_counter()
        jax.profiler.stop_trace()
        steps = step - self.first_traced + 1
        table = breakdown(read_trace(self.trace_dir), self.module, steps)
        return table, time.perf_counter() - started
