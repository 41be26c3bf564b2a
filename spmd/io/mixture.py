"""Weighted mixtures of sources: `--data "web=path/a/*.parquet:0.7,code=path/b:0.3"`.

Each source is opened like a single `--data` (text, token .bin, record shards) and cut into its
own windows. Every global batch holds a fixed number of rows of each source: the weights x
batch, rounded by largest remainder (so 0.7 / 0.3 of a batch of 8 is 6 / 2 rows, printed at the
start; the proportion is exact to 1 / batch). Source i reads its rows from its own stream: its
train windows in a fresh permutation every epoch, drawn from (seed, i, epoch), so each of its
windows appears exactly once per epoch of that source, whatever the other sources do; a step
may straddle two epochs of a source. The rows of a step are then shuffled by (seed, step), so
every data-parallel shard sees the mix. The global batch at step t is a function of (seed,
step) only, as for one source (spmd.io.data). Each source's held-out windows are an eval set
named after it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re

import jax
import numpy as np

from spmd.errors import UsageError
from spmd.io import data

SOURCE = re.compile(r"^(?P<name>[A-Za-z_][\w.-]*)=(?P<path>.+?)(?::(?P<weight>[0-9.eE+-]+))?$")


def is_mixture(text: str) -> bool:
    """Whether `--data` names sources (name=path[:weight], comma-separated)."""
    return bool(text) and all(SOURCE.match(part.strip()) for part in text.split(","))


def parse_sources(text: str, flag: str = "--data", weighted: bool = True) -> list[tuple]:
    """[(name, path, weight)] of "name=path:weight,..."; weights normalized to sum to 1 (with
    `weighted` False, as for --eval-data, the weight is ignored)."""
    sources = []
    for part in text.split(","):
        match = SOURCE.match(part.strip())
        if not match:
            raise UsageError(f"{flag} {part!r} is not name=path:weight (e.g. web=data/*.jsonl:0.7)")
        weight = match["weight"]
        try:
            value = float(weight) if weight is not None else (0.0 if weighted else 1.0)
        except ValueError:
            value = -1.0
        if weighted and not value > 0:
            raise UsageError(f"{flag} {part!r}: give a positive weight after the path (:0.3)")
        sources.append((match["name"], match["path"], value))
    names = [name for name, _, _ in sources]
    if len(set(names)) < len(names):
        raise UsageError(f"{flag}: the source names {', '.join(names)} repeat; name each once")
    total = sum(weight for *_, weight in sources)
    return [(name, path, weight / total) for name, path, weight in sources]


def rows_per_step(weights: list[float], batch: int, names: list[str]) -> list[int]:
    """Rows of each source in a batch: weights x batch by largest remainder (ties: first)."""
    exact = np.asarray(weights) * batch
    rows = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - rows), kind="stable")[: batch - rows.sum()]:
        rows[i] += 1
    empty = [name for name, n in zip(names, rows, strict=True) if n == 0]
    if empty:
        raise UsageError(
            f"--batch {batch} leaves no row for source {empty[0]} (weight "
            f"{weights[names.index(empty[0])]:.3g}); use a larger --batch or a larger weight"
        )
    return rows.tolist()


@functools.lru_cache(maxsize=16)
def source_order(seed: int, source: int, epoch: int, n_train: int) -> np.ndarray:
    """The permutation of a source's train windows that its epoch `epoch` visits."""
    order = np.random.default_rng([seed, source, epoch]).permutation(n_train)
    order.flags.writeable = False
    return order


@dataclasses.dataclass
class Mixture:
    """Several sources' windows, sampled by weight; used where one TokenWindows would be."""

    names: list[str]
    sources: list[data.TokenWindows]
    weights: list[float]
    batch: int

    def __post_init__(self) -> None:
        self.rows = rows_per_step(self.weights, self.batch, self.names)
        self.seq_len = self.sources[0].seq_len
        self.n_eval = 0  # the sources' held-out windows are eval sets of their own
        fields = {s.fields for s in self.sources}
        if len(fields) > 1:
            raise UsageError(
                f"the sources {', '.join(self.names)} give batches of different kinds "
                f"({' vs '.join('/'.join(f) for f in fields)}); mix sources that are all text or "
                f"all prompt/response, under one --document-mask"
            )
        self.fields = self.sources[0].fields

    def describe(self) -> str:
        return ", ".join(
            f"{name} {rows}/{self.batch} rows (weight {weight:.3g})"
            for name, rows, weight in zip(self.names, self.rows, self.weights, strict=True)
        )

    def step_rows(self, seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window id) of each row of data step `step`'s global batch."""
        sources, ids = [], []
        for i, (windows, rows) in enumerate(zip(self.sources, self.rows, strict=True)):
            stream = step * rows + np.arange(rows)  # positions in this source's stream
            epochs, within = np.divmod(stream, windows.n_train)
            for epoch in np.unique(epochs):
                order = source_order(seed, i, int(epoch), windows.n_train)
                ids.append(order[within[epochs == epoch]])
            sources.append(np.full(rows, i))
        shuffle = np.random.default_rng([seed, step, len(self.sources)]).permutation(self.batch)
        return np.concatenate(sources)[shuffle], np.concatenate(ids)[shuffle]

    def batch_at(
        self, seed: int, step: int, global_batch: int, sharding: jax.sharding.Sharding
    ) -> dict[str, jax.Array]:
        """The global batch of data step `step` (0-based); this process reads only its rows."""
        sources, ids = self.step_rows(seed, step)
        shape = (global_batch, self.seq_len)
        rows = data.local_rows(sharding, shape)
        local: dict[str, np.ndarray] = {}
        for i, windows in enumerate(self.sources):
            mine = np.flatnonzero(sources[rows] == i)
            for key, value in windows.batch_rows(ids[rows][mine]).items():
                local.setdefault(key, np.zeros((len(rows), *value.shape[1:]), value.dtype))
                local[key][mine] = value
        if "weights" in self.fields:
            mask = np.zeros(shape, np.float32)
            for i, windows in enumerate(self.sources):
                mask[sources == i] = windows.target_mask(ids[sources == i])
            local["weights"] = data.normalized(mask)[rows]
        return data.put_local(local, sharding, shape)

    def source_tokens(self, steps: int) -> dict[str, int]:
        """Tokens (inputs) each source has given after `steps` optimizer steps."""
        return {
            name: steps * rows * self.seq_len
            for name, rows in zip(self.names, self.rows, strict=True)
        }

    def eval_sets(self) -> dict[str, data.TokenWindows]:
        """Each source's held-out windows, by source name (sources without any left out)."""
        return {n: w for n, w in zip(self.names, self.sources, strict=True) if w.n_eval}


def fingerprint(names: list[str], weights: list[float], fingerprints: list[str]) -> str:
    """What a checkpoint's data state records of a mixture: its sources' token fingerprints,
    names and weights (another mixture is another data order)."""
    text = json.dumps([names, [round(w, 12) for w in weights], fingerprints])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
