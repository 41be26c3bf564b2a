"""Epochs: how long `--epochs N` trains, and how many passes over the data a step has made.

An epoch is one pass over the training windows after packing (W: a corpus's train windows, a
preference corpus's train pairs, a mixture's first source's train windows). A step reads B of
them (the global batch `--batch`, whatever `--accum` splits it into: a step consumes B
sequences; B / 2 pairs; a mixture's first source its rows of the batch), so `--epochs N` runs
ceil(N W / B) steps.

Under `--epochs` the windows are read as one stream of epochs (spmd.io.data.train_window_ids
with `stream`): epoch e's permutation, drawn from (seed, e), follows epoch e - 1's, no window is
left out at an epoch's end, and a step may straddle two epochs. So the first N W windows read
hold each window exactly N times. The last step's rows past N W wrap into epoch N + 1 (the
batch shape is fixed): ceil(N W / B) B - N W windows are read once more; the summary record
counts the reads of every epoch (`windows_per_epoch`). A mixture streams every source already
(spmd.io.mixture), so its order is the same with or without `--epochs`. Without `--epochs` a
single corpus's order skips the W mod B windows left over at each epoch's end, as it always did
(old checkpoints resume unchanged): its epoch count is then steps / floor(W / B).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from spmd.io import data, mixture


@dataclasses.dataclass(frozen=True)
class Passes:
    """What an epoch is for a run's windows: `total` units (windows, pairs or the first
    source's windows), `per_step` of them read by a step; `stream` says whether the order
    leaves none out at an epoch's end."""

    total: int
    per_step: int
    stream: bool
    what: str  # for people: "windows", "pairs", "windows of source web"

    def steps_for(self, epochs: int) -> int:
        """The optimizer steps that read `epochs` passes: ceil(epochs x total / per_step)."""
        return math.ceil(epochs * self.total / self.per_step)

    def epoch(self, data_steps: int) -> float:
        """Passes over the data after `data_steps` steps' windows were read."""
        if self.stream:
            return data_steps * self.per_step / self.total
        return data_steps / (self.total // self.per_step)  # whole epochs, leftovers skipped


def passes(windows: Any, batch: int) -> Passes:
    """The Passes of a run's windows (a TokenWindows, PairWindows or Mixture) at global batch
    `batch`, in the order they are read now."""
    if isinstance(windows, mixture.Mixture):
        first = windows.names[0]
        return Passes(windows.sources[0].n_train, windows.rows[0], True, f"windows of {first}")
    if hasattr(windows, "n_pairs"):  # spmd.io.pairs.PairWindows
        return Passes(windows.n_train // 2, batch // 2, windows.stream, "pairs")
    return Passes(windows.n_train, batch, windows.stream, "windows")


def stream_epochs(windows: Any) -> None:
    """Read `windows` as one stream of epochs from now on (a mixture already is one)."""
    if not isinstance(windows, mixture.Mixture):
        windows.stream = True


def units_read(windows: Any, seed: int, batch: int, data_step: int) -> np.ndarray:
    """The units (window, pair, or the first source's window ids) data step `data_step` reads,
    by the same functions its batch is made with."""
    if isinstance(windows, mixture.Mixture):
        sources, ids = windows.step_rows(seed, data_step)
        return ids[sources == 0]
    if hasattr(windows, "n_pairs"):
        stream = windows.stream
        return data.train_window_ids(seed, data_step, batch // 2, windows.n_train // 2, stream)
    return data.train_window_ids(seed, data_step, batch, windows.n_train, windows.stream)


def windows_per_epoch(
    windows: Any, seed: int, batch: int, data_steps: list[int]
) -> list[dict[str, int]]:
    """For each epoch the run's `data_steps` touched: {"epoch" (1-based), "reads" (units
    read in it), "distinct" (different units among them)}, counted from the ids the steps
    read."""
    info = passes(windows, batch)
    reads: dict[int, list[np.ndarray]] = {}
    for step in data_steps:
        ids = units_read(windows, seed, batch, step)
        if info.stream:
            positions = step * info.per_step + np.arange(len(ids))
            epochs = positions // info.total
        else:
            epochs = np.full(len(ids), step // (info.total // info.per_step))
        for epoch in np.unique(epochs):
            reads.setdefault(int(epoch), []).append(ids[epochs == epoch])
    return [
        {
            "epoch": epoch + 1,
            "reads": int(sum(len(part) for part in parts)),
            "distinct": int(len(np.unique(np.concatenate(parts)))),
        }
        for epoch, parts in sorted(reads.items())
    ]
