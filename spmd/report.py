"""`python -m spmd.report RUN.jsonl [MORE.jsonl ...] --out report.png`: runs side by side.

Draws loss, throughput (tokens/s) and step time against step from the train records of each
metrics JSONL (spmd.observe.metrics), one line per run, labelled with its mesh and ZeRO stage, so
layouts can be compared at a glance. Needs matplotlib (the optional extra `report`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from spmd import config
from spmd.config import flat_values
from spmd.errors import UsageError, run_command

PANELS = (  # (train record field, axis label, scale applied to the values)
    ("loss", "loss (nats/token)", 1.0),
    ("tokens_per_s", "throughput (tokens/s)", 1.0),
    ("step_time_s", "step time (ms)", 1e3),
)


def load_run(path: str | Path) -> tuple[str, list[dict]]:
    """(label, train records) of one metrics JSONL; the label says the mesh (and the ZeRO
    stage where an fsdp axis makes it matter)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: line {e.lineno} is not JSON; expected a metrics JSONL") from None
    config = next((r for r in records if r.get("kind") == "config"), None)
    train = [r for r in records if r.get("kind") == "train"]
    if config is None or not train:
        raise UsageError(f"{path}: no config and train records; is it a spmd.train --metrics file?")
    zero = flat_values(config.get("config", {})).get("zero")
    label = config.get("mesh_text") or str(config.get("mesh"))
    sharded = config.get("mesh", {}).get("fsdp", 1) > 1  # the stage means nothing otherwise
    return (f"{label} zero{zero}" if sharded and zero is not None else label), train


def draw(runs: list[tuple[str, list[dict]]], out: str | Path) -> None:
    """Write one PNG (or any format matplotlib infers from `out`) with a panel per metric."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(
            "spmd.report needs matplotlib; install it with pip install -e '.[report]'"
        ) from None
    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    for ax, (field, title, scale) in zip(axes, PANELS, strict=True):
        for label, records in runs:
            points = [(r["step"], r[field] * scale) for r in records if r.get(field) is not None]
            ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(title="mesh")
    fig.savefig(out, dpi=100)
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    """Where the picture goes."""

    out: str = "report.png"  # image to write


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    files = config.Positional("metrics", "+", "metrics JSONL files of spmd.train runs")
    resolved = config.resolve(
        argv,
        {"report": ReportConfig},
        "python -m spmd.report",
        description=__doc__,
        positional=files,
    )
    paths, out = resolved["metrics"], resolved["report"].out
    runs = [load_run(path) for path in paths]
    labels = [label for label, _ in runs]
    runs = [  # two runs of one layout: tell them apart by file name
        (f"{label} ({Path(path).stem})" if labels.count(label) > 1 else label, records)
        for path, (label, records) in zip(paths, runs, strict=True)
    ]
    draw(runs, out)
    print(f"wrote {out}: {len(runs)} run(s): {', '.join(label for label, _ in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
