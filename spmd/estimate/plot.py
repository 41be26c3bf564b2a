"""The plan as a picture (`python -m spmd.plan ... --plot plan.png`).

Left: memory per device as stacked bars (params, gradients, master + optimizer state,
activations, overhead) for ZeRO 0, 1, 2 and 3 over every device (the ZeRO paper's
comparison, at the layout's micro-batch and remat) and for the planned layout, with the HBM
as a line; bars taller than the axis are cut and labelled with their total. Right: where the
step time goes (compute, each collective's exposed time, the pipeline bubble) for the planned
layout and, after --recommend, its runner-ups. Needs matplotlib. Units: GB (1e9 bytes),
seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spmd.errors import UsageError
from spmd.estimate import comms, cost, memory, search, timing
from spmd.parallel.mesh import format_mesh

ROLES = ("params", "grads", "optimizer", "activations", "overhead")
ROLE_LABELS = ("params", "gradients", "master + optimizer", "activations", "overhead")
ROLE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c")


def exposed_parts(s: cost.Setup, cluster: search.Cluster) -> dict[str, float]:
    """Seconds of one step by part: compute (model FLOPs), recomputation, each collective's
    exposed time, bubble."""
    t = timing.step_time(s, cluster.net, cluster.flops, cluster.overlap)
    planned = comms.collectives(s)
    hideable = sum(comms.comm_time(s, c, cluster.net) for c in planned if c.hideable)
    kept = 1 - t["hidden"] / hideable if hideable else 1.0
    model = timing.model_flops(s) / s.devices / cluster.flops
    parts = {"compute": model, "recomputation": t["compute"] - model}
    for c in planned:
        key = f"{c.kind} {'+'.join(c.axes)} ({c.purpose})"
        seconds = comms.comm_time(s, c, cluster.net) * (kept if c.hideable else 1.0)
        parts[key] = parts.get(key, 0.0) + seconds
    parts["bubble"] = t["bubble"]
    parts["host transfers (--offload, --remat offload)"] = t["host"]
    return {k: v for k, v in parts.items() if v > 0}


def draw(s: cost.Setup, cluster: search.Cluster, chosen: Any | None, out: str | Path) -> None:
    """Write the picture of layout `s` (and, with a spmd.estimate.recommend.Recommendation
    `chosen`, its runner-ups) to `out` (PNG, or any format matplotlib infers)."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib; pip install -e '.[report]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib import pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1, 1.4]})
    _memory_panel(left, s, cluster)
    layouts = [("planned", s)]
    if chosen is not None:
        layouts = [("recommended", s)] + [("runner-up", c.setup) for c in chosen.runner_ups]
    _time_panel(right, layouts, cluster)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as e:
        raise UsageError(f"--plot {out}: cannot write the picture ({e})") from None
    finally:
        plt.close(fig)


def _memory_panel(ax: Any, s: cost.Setup, cluster: search.Cluster) -> None:
    stages = [(f"ZeRO-{v.zero}\n{format_mesh(v.mesh)}", v) for v in memory.zero_stages(s)]
    bars = stages + [(f"planned\n{format_mesh(s.mesh)}\nZeRO-{s.zero}", s)]
    mems = [cluster.memory(setup) for _, setup in bars]
    hbm = cluster.hbm / 1e9
    top = max(2.2 * hbm, 1.1 * min(max(m["total"] for m in mems) / 1e9, 3 * hbm))
    x = range(len(bars))
    bottom = [0.0] * len(bars)
    for role, label, color in zip(ROLES, ROLE_LABELS, ROLE_COLORS, strict=True):
        # what --offload keeps in host memory is not in the device's bar
        heights = [
            0.0 if role in memory.HOST_ROLES[setup.offload] else m[role] / 1e9
            for m, (_, setup) in zip(mems, bars, strict=True)
        ]
        ax.bar(x, heights, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.axhline(hbm, color="black", linestyle="--", linewidth=1)
    ax.text(-0.45, hbm, f"HBM {hbm:g} GB", va="bottom", ha="left")
    for i, m in enumerate(mems):
        total = m["total"] / 1e9
        ax.text(i, min(total, top * 0.97), f"{total:,.1f} GB", ha="center", va="bottom")
    ax.set_ylim(0, top)
    ax.set_xticks(list(x), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("GB per device (1e9 bytes)")
    ax.set_title(f"memory per device, {s.precision}, micro-batch {s.micro_batch}, remat {s.remat}")
    ax.legend(fontsize=8, loc="upper right")


def _time_panel(ax: Any, layouts: list[tuple[str, cost.Setup]], cluster: search.Cluster) -> None:
    rows = [
        (f"{kind}\n{format_mesh(s.mesh)} z{s.zero}", exposed_parts(s, cluster))
        for kind, s in layouts
    ]
    keys = list(dict.fromkeys(k for _, parts in rows for k in parts))
    colors = _colors(keys)
    labelled: set[str] = set()
    for i, (_, parts) in enumerate(reversed(rows)):
        left = 0.0
        for key in keys:
            width = parts.get(key, 0.0)
            if width:
                label = None if key in labelled else key
                labelled.add(key)
                ax.barh(i, width, left=left, color=colors[key], label=label)
                left += width
        ax.text(left, i, f" {left:.3g} s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)], fontsize=8)
    ax.set_xlabel("seconds per optimizer step")
    ax.set_title(f"step time: compute at {cluster.flops / 1e12:g} TFLOP/s + exposed comm + bubble")
    ax.set_xlim(0, 1.15 * max(sum(parts.values()) for _, parts in rows))
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)


def _colors(keys: list[str]) -> dict[str, Any]:
    """Compute blues, bubble grey, each collective its own colour of matplotlib's tab20."""
    from matplotlib import colormaps

    table = colormaps["tab20"]
    fixed = {"compute": "#4c72b0", "recomputation": "#a6bddb", "bubble": "#8c8c8c"}
    others = [k for k in keys if k not in fixed]
    return {k: table((2 * i + 2) % 20) for i, k in enumerate(others)} | fixed
