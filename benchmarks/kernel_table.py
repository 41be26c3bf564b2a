"""Where a traced step's device time goes: the kernels of a jax.profiler Perfetto trace
(`perfetto_trace.json.gz`, what `spmd.train --profile A:B` writes) summed by name on the
device planes and grouped in coarse categories (matmul, attention, copy, collective, other).

    python benchmarks/kernel_table.py TRACE.json.gz [STEPS_TRACED]
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import sys
from typing import Any

CATEGORIES = (  # first match wins: (category, pattern over the lower-cased kernel name)
    ("collective", r"all-reduce|all-gather|reduce-scatter|nccl|all-to-all|collective"),
    ("attention", r"flash|fmha|cudnn|sdpa|attention"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|matmul|cublas|dot"),
    ("copy", r"memcpy|memset|copy|dynamic-update-slice|dynamic_update_slice"),
)
SUMMARY_THREADS = r"XLA Ops|XLA Modules|Steps|TraceMe|Source"  # the same kernels, summarised
# device-to-device copies, as the CUDA runtime names them (memcpy128, memcpy32_post: XLA:GPU's
# copies and dynamic-slice / dynamic-update-slice memcpys inside command buffers); the issue's
# oracle is their time per step, apart from the copy category's memsets and in-place slices
MEMCPY = r"^memcpy"


def category(name: str) -> str:
    lower = name.lower()
    return next((c for c, pattern in CATEGORIES if re.search(pattern, lower)), "other")


def kernel_table(events: list[dict[str, Any]], steps: int = 1) -> dict[str, Any]:
    """{"planes", "ms_per_step", "window_ms_per_step", "categories": {name: ms per step},
    "memcpy": {"ms_per_step", "calls_per_step"}, "top": [(ms per step, calls per step,
    kernel)]} of the trace's device-plane events."""
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e["tid"])] = e["args"]["name"]
    device = {p for p, n in process.items() if re.search(r"/device:(gpu|tpu)", n, re.I)}
    time_us: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    start, end = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device:
            continue
        if re.search(SUMMARY_THREADS, thread.get((e["pid"], e["tid"]), "")):
            continue
        time_us[e["name"]] += e.get("dur", 0)
        calls[e["name"]] += 1
        start, end = min(start, e["ts"]), max(end, e["ts"] + e.get("dur", 0))
    by_category: collections.Counter = collections.Counter()
    for name, us in time_us.items():
        by_category[category(name)] += us / 1e3 / steps
    memcpy = [(n, us) for n, us in time_us.items() if re.search(MEMCPY, n.lower())]
    return {
        "planes": sorted(process[p] for p in device),
        "ms_per_step": sum(time_us.values()) / 1e3 / steps,
        "window_ms_per_step": (end - start) / 1e3 / steps if time_us else 0.0,
        "categories": dict(by_category.most_common()),
        "memcpy": {
            "ms_per_step": sum(us for n, us in memcpy) / 1e3 / steps,
            "calls_per_step": sum(calls[n] for n, _ in memcpy) / steps,
        },
        "top": [(us / 1e3 / steps, calls[n] / steps, n) for n, us in time_us.most_common(15)],
    }


def read(path: str) -> list[dict[str, Any]]:
    with gzip.open(path) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def format_table(table: dict[str, Any]) -> str:
    total = table["ms_per_step"] or 1.0
    lines = [f"kernels {table['ms_per_step']:.1f} ms per step on {', '.join(table['planes'])}"]
    lines += [f"  {c:12} {ms:8.1f} ms {ms / total:6.1%}" for c, ms in table["categories"].items()]
    memcpy = table["memcpy"]
    lines.append(f"  memcpy       {memcpy['ms_per_step']:8.1f} ms {memcpy['calls_per_step']:6.0f}x")
    lines += [f"  {ms:8.2f} ms {n:6.0f}x  {name[:90]}" for ms, n, name in table["top"]]
    return "\n".join(lines)


if __name__ == "__main__":
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    print(format_table(kernel_table(read(sys.argv[1]), steps)))
