"""`python -m spmd.report RUN [MORE ...] [--out report.png]`: runs side by side.

Each RUN is a run folder of spmd.train (its metrics.jsonl is read, spmd.training.run_folder) or
a metrics JSONL file, a local path or a URL (spmd.paths). Draws loss, eval loss, learning
rate, throughput (tokens/s) and step time against step from the records of each
(spmd.observe.metrics), one line per run and mesh, labelled with its mesh and ZeRO stage, so
layouts can be compared at a glance; for a mixture of experts also the expert load max / mean
of each layer (and, where choices drop, each layer's dropped fraction), a line per layer. A
run resumed on another mesh has a line per mesh (each start's config record begins a
segment); dotted vertical lines mark each resume, dashed red ones each rollback. The picture
goes to --out, by default the run folder's report.png when one run folder is given, else
./report.png. A run folder holding samples.jsonl (--sample-every) gets samples.md beside it, a
Markdown table of prompts and completions per sampled step; an --epochs run's epoch count is in
the closing line. Needs matplotlib (the optional extra `report`:
pip install -e '.[report]').
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from spmd import paths
from spmd.errors import UsageError, run_command
from spmd.run import config
from spmd.run.config import flat_values
from spmd.training.run_folder import METRICS_FILE, REPORT_FILE, SAMPLES_FILE, SAMPLES_REPORT, join

PANELS = (  # (record kind, field, axis label, scale applied to the values)
    ("train", "loss", "loss (nats/token)", 1.0),
    ("eval", "loss", "eval loss (nats/token)", 1.0),
    ("train", "lr", "learning rate", 1.0),
    ("train", "tokens_per_s", "throughput (tokens/s)", 1.0),
    ("train", "step_time_s", "step time (ms)", 1e3),
)
# An MoE run's per-layer router figures (lists, one entry a layer; models.moe.router_stats):
# a panel each, a line per layer, where some train record holds them (the dropped fraction
# only where some layer drops a choice): (field, axis label)
LAYER_PANELS = (
    ("expert_load_max_over_mean_by_layer", "expert load max / mean, per sparse layer"),
    ("dropped_fraction_by_layer", "dropped fraction, per sparse layer"),
)
# A preference run's figures (spmd.engine.preference_loss, TRL's names): a panel each where
# some train record holds them, as the other train panels
PREFERENCE_PANELS = (
    ("train", "rewards/margins", "reward margin, chosen - rejected (nats)", 1.0),
    ("train", "rewards/accuracies", "preference accuracy (share of pairs)", 1.0),
)
MARKERS = {"resume": ("grey", ":"), "rollback": ("red", "--")}  # kind -> (colour, line style)


@dataclasses.dataclass(frozen=True)
class Run:
    """What one metrics file draws: a segment per start (a resume may change the mesh)."""

    label: str  # the first segment's mesh label
    segments: list[tuple[str, list[dict]]]  # (mesh label, the train and eval records it wrote)
    markers: list[tuple[int, str]]  # (step, "resume" or "rollback")
    epoch: float | None = None  # an --epochs run's passes over the data at its last record


def load_run(path: str | Path) -> tuple[str, list[dict]]:
    """(label, train records) of one metrics JSONL; the label says the mesh (and the ZeRO
    stage where an fsdp axis makes it matter) of its first start."""
    run = load_segments(path)
    return run.label, [r for _, records in run.segments for r in records if r["kind"] == "train"]


def load_segments(path: str | Path) -> Run:
    """The Run of one metrics JSONL: its records split at each config record (each start of
    the run), labelled with that start's mesh, and its resume and rollback steps."""
    try:
        text = paths.read_text(str(path))
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path} is not UTF-8 text (byte {e.start}); expected a metrics JSONL"
        ) from None
    records = []
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line) if line.strip() else {}
        except ValueError:
            record = None
        if not isinstance(record, dict) or not _fields_ok(record):
            if number == len(lines) and not text.endswith("\n"):  # a run writing it, or cut
                print(
                    f"warning: {path}: its last line is cut short ({len(line)} characters "
                    f"without an end of line: a write in progress, or one that failed); left out",
                    file=sys.stderr,
                )
                break
            raise UsageError(f"{path}: line {number} is not a metrics record; expected a JSONL")
        records.append(record)
    segments: list[tuple[str, list[dict]]] = []
    markers: list[tuple[int, str]] = []
    for record in records:
        kind = record.get("kind")
        if kind == "config":
            segments.append((mesh_label(record), []))
        elif kind in ("train", "eval") and segments:
            segments[-1][1].append(record)
        elif kind == "resume" or (kind == "anomaly" and record.get("action") == "rollback"):
            step = record.get("restored_step", record.get("step"))
            if isinstance(step, int):  # a record without a step has nowhere to be drawn
                markers.append((step, "resume" if kind == "resume" else "rollback"))
    if not any(r["kind"] == "train" for _, rs in segments for r in rs):
        raise UsageError(f"{path}: no config and train records; is it a spmd.train --metrics file?")
    epochs = [
        r
        for r in records
        if r.get("kind") == "config" and flat_values(r.get("config", {})).get("epochs")
    ]
    trained = [r for _, rs in segments for r in rs if r["kind"] == "train" and "epoch" in r]
    epoch = trained[-1]["epoch"] if epochs and trained else None
    return Run(segments[0][0], segments, markers, epoch)


def mesh_label(config: dict) -> str:
    """A config record's mesh, with the ZeRO stage where an fsdp axis makes it matter."""
    zero = flat_values(config.get("config", {})).get("zero")
    label = config.get("mesh_text") or str(config.get("mesh"))
    sharded = config.get("mesh", {}).get("fsdp", 1) > 1  # the stage means nothing otherwise
    return f"{label} zero{zero}" if sharded and zero is not None else label


def _fields_ok(record: dict) -> bool:
    """Whether a record's fields that draw() and the label read have their types: a train
    record's step and panels are numbers (or null), its per-layer figures lists of numbers, a
    config record's tables objects."""
    number = (int, float, type(None))
    if record.get("kind") in ("train", "eval"):
        every = PANELS + PREFERENCE_PANELS
        panels = [record.get(field) for kind, field, _, _ in every if kind == record["kind"]]
        step = record.get("step")
        layers = [record.get(field, []) for field, _ in LAYER_PANELS]
        lists_ok = all(
            isinstance(v, list) and all(isinstance(x, int | float) for x in v) for v in layers
        )
        panels_ok = all(isinstance(v, number) for v in panels)
        return isinstance(step, int | float) and panels_ok and lists_ok
    if record.get("kind") == "config":
        mesh, tables = record.get("mesh", {}), record.get("config", {})
        sizes_ok = isinstance(mesh, dict) and all(isinstance(v, int) for v in mesh.values())
        return sizes_ok and isinstance(tables, dict)
    return True


def run_folder_of(path: str) -> str:
    """`path` when it is a run folder (a folder holding metrics.jsonl), else ""."""
    local = paths.local(path)
    if paths.is_url(local):
        return path if paths.exists(join(local, METRICS_FILE)) else ""
    return local if (Path(local) / METRICS_FILE).is_file() else ""


def check_out(out: str) -> None:
    """UsageError unless matplotlib can write `out`: a format it knows (by the suffix) into a
    folder that exists; checked before any file is read."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(
            "spmd.report needs matplotlib; install it with pip install -e '.[report]'"
        ) from None
    formats = Figure().canvas.get_supported_filetypes()
    suffix = Path(out).suffix[1:].lower()
    if suffix not in formats:
        raise UsageError(
            f"--out {out}: {suffix or 'no suffix'} is not an image format matplotlib writes; "
            f"end it in one of .{', .'.join(sorted(formats))}"
        )
    if not Path(out).absolute().parent.is_dir():
        raise UsageError(f"--out {out}: the folder {Path(out).parent} does not exist")


def draw(runs: list[tuple[str, Run]], out: str | Path) -> None:
    """Write one PNG (or any format matplotlib infers from `out`) with a panel per metric: a
    line per (run, mesh segment), the resume and rollback steps as vertical lines."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(
            "spmd.report needs matplotlib; install it with pip install -e '.[report]'"
        ) from None
    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib import pyplot as plt

    panels, layer_panels = panels_of(runs), layer_panels_of(runs)
    count = len(panels) + len(layer_panels)
    fig, axes = plt.subplots(1, count, figsize=(5 * count, 4), constrained_layout=True)
    for ax, (field, title) in zip(axes[len(panels) :], layer_panels, strict=True):
        draw_layers(ax, runs, field, title)
    for ax, (kind, field, title, scale) in zip(axes[: len(panels)], panels, strict=True):
        for name, run in runs:
            for mesh, records in run.segments:
                points = [
                    (r["step"], r[field] * scale)
                    for r in records
                    if r["kind"] == kind and r.get(field) is not None
                ]
                label = name if len(run.segments) == 1 else f"{name}: {mesh}"
                ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=label)
            for step, what in run.markers:
                colour, style = MARKERS[what]
                ax.axvline(step, color=colour, linestyle=style, linewidth=1, label=f"_{what}")
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(title="mesh (: resumed, - - rolled back)")
    fig.savefig(out, dpi=100)
    plt.close(fig)


def panels_of(runs: list[tuple[str, Run]]) -> list[tuple[str, str, str, float]]:
    """PANELS, and the PREFERENCE_PANELS some of the runs' train records fill."""
    records = [r for _, run in runs for _, rs in run.segments for r in rs if r["kind"] == "train"]
    filled = [p for p in PREFERENCE_PANELS if any(r.get(p[1]) is not None for r in records)]
    return [*PANELS, *filled]


def layer_panels_of(runs: list[tuple[str, Run]]) -> list[tuple[str, str]]:
    """The LAYER_PANELS the runs' train records fill: the load where some record holds it,
    the dropped fraction where some layer dropped a choice."""
    records = [r for _, run in runs for _, rs in run.segments for r in rs if r["kind"] == "train"]
    filled = {field: [r.get(field) or [] for r in records] for field, _ in LAYER_PANELS}
    wanted = {field: any(filled[field]) for field in filled}
    wanted["dropped_fraction_by_layer"] = any(any(v) for v in filled["dropped_fraction_by_layer"])
    return [(field, title) for field, title in LAYER_PANELS if wanted[field]]


def draw_layers(ax: Any, runs: list[tuple[str, Run]], field: str, title: str) -> None:
    """A line per (run, mesh segment, layer) of the per-layer list `field` against step."""
    lines = 0
    for name, run in runs:
        for mesh, records in run.segments:
            points = [
                (r["step"], r[field]) for r in records if r["kind"] == "train" and r.get(field)
            ]
            label = name if len(run.segments) == 1 else f"{name}: {mesh}"
            for layer in range(max((len(v) for _, v in points), default=0)):
                steps = [s for s, v in points if layer < len(v)]
                values = [v[layer] for _, v in points if layer < len(v)]
                ax.plot(steps, values, marker=".", label=f"{label}, layer {layer}")
                lines += 1
    ax.set_xlabel("step")
    ax.set_ylabel(title)
    ax.grid(alpha=0.3)
    if lines <= 16:  # beyond, a legend would hide the lines
        ax.legend(fontsize="small")


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    """Where the picture goes."""

    out: str = ""  # image to write (empty: RUN/report.png for one run folder, else report.png)


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    metrics = config.Positional(
        "metrics", "+", "run folders or metrics JSONL files of spmd.train runs"
    )
    resolved = config.resolve(
        argv,
        {"report": ReportConfig},
        "python -m spmd.report",
        description=__doc__,
        positional=metrics,
    )
    given, out = resolved["metrics"], resolved["report"].out
    folders = [run_folder_of(path) for path in given]
    files = [
        join(folder, METRICS_FILE) if folder else p
        for p, folder in zip(given, folders, strict=True)
    ]
    if not out:
        out = join(folders[0], REPORT_FILE) if len(given) == 1 and folders[0] else REPORT_FILE
    check_out(out)
    loaded = [load_segments(path) for path in files]
    labels = [run.label for run in loaded]
    runs = [  # two runs of one layout: tell them apart by file name
        (f"{run.label} ({Path(path).stem})" if labels.count(run.label) > 1 else run.label, run)
        for path, run in zip(given, loaded, strict=True)
    ]
    draw(runs, out)
    print(f"wrote {out}: {len(runs)} run(s): {', '.join(describe(n, r) for n, r in runs)}")
    for folder in folders:
        if folder and not paths.is_url(folder) and (Path(folder) / SAMPLES_FILE).is_file():
            print(f"wrote {write_samples(folder)}: the samples of --sample-every")
    return 0


def write_samples(folder: str) -> str:
    """Write a run folder's samples.jsonl as samples.md beside it (a table per sampled step);
    returns its path. UsageError for a line that is not a sample."""
    from spmd.observe.trackers import samples_markdown

    source = Path(folder) / SAMPLES_FILE
    by_step: dict[int, list[dict]] = {}
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        fields = ("step", int), ("prompt", str), ("completion", str)
        if not isinstance(row, dict) or not all(isinstance(row.get(k), t) for k, t in fields):
            raise UsageError(f"{source}: line {number} is not a sample (step, prompt, completion)")
        by_step.setdefault(row["step"], []).append(row)
    parts = [
        f"## step {step}\n\n{samples_markdown(rows)}" for step, rows in sorted(by_step.items())
    ]
    target = Path(folder) / SAMPLES_REPORT
    target.write_text(f"# Samples of {folder}\n\n" + "\n\n".join(parts) + "\n", encoding="utf-8")
    return str(target)


def describe(name: str, run: Run) -> str:
    """A run in the closing line: its name, and its meshes and markers where it has more."""
    meshes = [mesh for mesh, _ in run.segments]
    more = [f"meshes {' -> '.join(meshes)}"] if len(set(meshes)) > 1 else []
    more += [f"{run.epoch:.2f} epochs"] if run.epoch is not None else []
    for what in MARKERS:
        count = sum(1 for _, kind in run.markers if kind == what)
        more += [f"{count} {what}(s)"] if count else []
    return name + (f" ({', '.join(more)})" if more else "")


if __name__ == "__main__":
    sys.exit(main())
