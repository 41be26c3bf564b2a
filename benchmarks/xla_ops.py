"""Per-op time of a compiled XLA step, from a jax.profiler trace: where XLA:CPU spends a step.

Each executed HLO instruction is one trace event (spmd/observe/profile.py reads them). An
instruction is labelled by its opcode and the JAX primitive its metadata names, e.g.
`fusion(kLoop):exp` or `dot:dot_general`, so the table reads beside torch.profiler's ops.
Control flow (`while`, `call`, `conditional`) is left out: its events span the ops it runs.
Ops of one step may run on several threads at once, so the column sums can exceed the wall
time of a step. They can also fall short of it: in the benchmark model's forward + backward
(one device, 2026-11-25), 44 ms of a 334 ms step had no op event running, most of it just
before ops that read a matmul's result, so the events do not cover all of XLA:CPU's matmul
work and the dot rows undercount it.
"""

from __future__ import annotations

import collections
import re
import tempfile
from collections.abc import Callable
from typing import Any

KIND = re.compile(r"kind=(k\w+)")
OP_NAME = re.compile(r'op_name="([^"]+)"')


def labels(hlo_text: str) -> dict[str, str]:
    """{instruction name: "opcode(kind):primitive"} over every computation of the module."""
    from spmd.estimate import hlo

    out = {}
    for _, name, _, opcode, attrs, _ in hlo.instructions(hlo_text):
        kind = KIND.search(attrs)
        op_name = OP_NAME.search(attrs)
        primitive = op_name.group(1).rsplit("/", 1)[-1] if op_name else ""
        out[name] = f"{opcode}({kind.group(1)})" if kind else opcode
        out[name] += f":{primitive}" if primitive else ""
    return out


def op_table(run_steps: Callable[[int], None], steps: int, compiled: Any) -> list[tuple]:
    """[(label, ms per step summed over the events, events per step)], largest first, of
    `steps` calls of run_steps(1) traced together."""
    import jax

    from spmd.observe import profile

    names, module = labels(compiled.as_text()), profile.module_name(compiled)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        run_steps(steps)
        jax.profiler.stop_trace()
        events = profile.read_trace(trace_dir)
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for event in events:
        if event.module != module or profile.op_category(event.hlo_op) == "control":
            continue
        label = names.get(event.hlo_op, re.sub(r"\.\d+$", "", event.hlo_op))
        total[label] += (event.end_ns - event.start_ns) / 1e6 / steps
        count[label] += 1
    rows = [(label, ms, count[label] / steps) for label, ms in total.items()]
    return sorted(rows, key=lambda row: -row[1])
