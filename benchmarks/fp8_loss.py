"""The fp8 loss table of docs/strategies/fp8.md: 300-step runs of a preset in bf16 and in fp8
(each recipe), one device, over a few seeds, their final loss (the mean of the last 20 steps'
training losses) and its change against bf16's run of the same seed.

    python benchmarks/fp8_loss.py --out /tmp/fp8loss [--models tiny small] [--seeds 0 1 2]
        [--recipes tensorwise rowwise delayed] [--min-dims 0 64] [--steps 300]

Each run is `python -m spmd.train ... --log-every 1` in a subprocess, its records written to
OUT/<model>_<precision>[_<recipe>_md<min-dim>]_s<seed>.jsonl; a run whose records are already
there (all its steps) is not run again, so the table can be built over several sittings and
a killed sweep resumed. The same seed gives the same init and data order to bf16 and fp8, so
the per-seed change is a paired difference; the bf16 spread across seeds (max - min of its
final losses, in % of their mean) says how large a difference the seed alone makes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import mean

CURVE_STARTS = (1, 51, 101, 151, 201, 281)  # the table's curve: means of 20 steps from these
LAST = 20  # "final loss": the mean of the last LAST steps' losses


def run_name(model: str, recipe: str | None, min_dim: int, seed: int) -> str:
    """The records' file stem of one run (recipe None: bf16)."""
    kind = "bf16" if recipe is None else f"fp8_{recipe}_md{min_dim}"
    return f"{model}_{kind}_s{seed}"


def losses(path: Path) -> list[float]:
    """The training losses of steps 1, 2, ... from a metrics JSONL (empty if none)."""
    if not path.exists():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            by_step[record["step"]] = record["loss"]
    return [by_step[s] for s in sorted(by_step)]


def train(out: Path, model: str, recipe: str | None, min_dim: int, seed: int, steps: int) -> None:
    """One run's records into OUT (skipped when they hold all `steps` already)."""
    name = run_name(model, recipe, min_dim, seed)
    metrics = out / f"{name}.jsonl"
    if len(losses(metrics)) >= steps:
        return
    metrics.unlink(missing_ok=True)
    shutil.rmtree(out / "runs" / name, ignore_errors=True)  # a killed run's checkpoint: not resumed
    argv = [
        sys.executable, "-m", "spmd.train", "--model", model, "--steps", str(steps),
        "--batch", "16", "--seq-len", "64", "--seed", str(seed), "--log-every", "1",
        "--eval-every", "0", "--checkpoint-every", "0", "--resume", "fresh",
        "--metrics", str(metrics), "--run-dir", str(out / "runs" / name),
    ]  # fmt: skip
    if recipe is not None:
        argv += ["--precision", "fp8", "--fp8-recipe", recipe, "--fp8-min-dim", str(min_dim)]
    else:
        argv += ["--precision", "bf16"]
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def final(values: list[float]) -> float:
    return mean(values[-LAST:])


def curve(values: list[float]) -> str:
    return " ".join(f"{mean(values[s - 1 : s - 1 + LAST]):.3f}" for s in CURVE_STARTS)


def table(
    out: Path,
    models: list[str],
    recipes: list[str],
    min_dims: list[int],
    seeds: list[int],
    steps: int,
) -> str:
    """The markdown rows: per preset, bf16 then each (recipe, min-dim), each seed's final loss
    and change against bf16's same seed, their mean, and the first seed's curve (runs not yet
    at `steps` are left out)."""

    def complete(name: str) -> list[float]:
        values = losses(out / f"{name}.jsonl")
        return values if len(values) >= steps else []

    lines = [
        "| preset | precision | `--fp8-min-dim` | final loss per seed | vs bf16 per seed | "
        "mean vs bf16 | curve (seed " + str(seeds[0]) + ") |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in models:
        base = {s: complete(run_name(model, None, 0, s)) for s in seeds}
        finals = {s: final(v) for s, v in base.items() if v}
        spread = (max(finals.values()) - min(finals.values())) / mean(finals.values())
        lines.append(
            f"| {model} | bf16 | | {' '.join(f'{finals[s]:.4f}' for s in finals)} | "
            f"(seed spread {100 * spread:.2f}%) | | {curve(base[seeds[0]])} |"
        )
        for recipe in recipes:
            for min_dim in min_dims:
                runs = {s: complete(run_name(model, recipe, min_dim, s)) for s in seeds}
                runs = {s: v for s, v in runs.items() if v and s in finals}
                if not runs:
                    continue
                change = {s: 100 * (final(v) / finals[s] - 1) for s, v in runs.items()}
                first = runs.get(seeds[0])
                each = " ".join(f"{final(runs[s]):.4f}" if s in runs else "—" for s in seeds)
                paired = " ".join(f"{change[s]:+.2f}%" if s in runs else "—" for s in seeds)
                lines.append(
                    f"| {model} | fp8 {recipe} | {min_dim} | {each} | {paired} | "
                    f"**{mean(change.values()):+.2f}%** | {curve(first) if first else ''} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise", "delayed"])
    parser.add_argument("--min-dims", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--table-only", action="store_true", help="only print the table")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for seed in args.seeds:
            for model in args.models:
                train(args.out, model, None, 0, seed, args.steps)
                for recipe in args.recipes:
                    for min_dim in args.min_dims:
                        train(args.out, model, recipe, min_dim, seed, args.steps)
    print(table(args.out, args.models, args.recipes, args.min_dims, args.seeds, args.steps))


if __name__ == "__main__":
    main()
