"""Deterministic, resumable, process-sharded token batches: the global batch at step t is a
function of (seed, step) only.

The token file (spmd.io.tokens, memory-mapped) is cut into windows of seq_len + 1 consecutive
tokens (inputs and next-token targets); the last `eval_fraction` of the windows is held out for
eval. Training visits the train windows in a fresh permutation every epoch, drawn from
(seed, epoch), and step t takes the slice [t*batch, (t+1)*batch) of that sequence: no mesh,
process count or device order enters. Each process reads only the rows its own devices hold
(from the batch sharding) and the global array is assembled with
`jax.make_array_from_process_local_data`. Under `--dcn-sync diloco` the same global batch is
read, and replica r (the r-th way of the data axis) trains on the rows its devices hold.

Why not grain's DataLoader: its `ShardByJaxProcess` gives each process a contiguous block of the
record order, so the global batch changes with the process count, and its per-process iterator
state cannot be restored onto another process count; both break the resume-anywhere contract.
A step-indexed sampler needs no iterator at all: its whole state is `data_state(...)`, a small
JSON object saved with every checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from spmd.errors import UsageError


@dataclasses.dataclass
class TokenWindows:
    """Windows of seq_len + 1 consecutive tokens over a token array, split train / eval
    (eval_fraction 1: an eval set, all held out).

    With `document_ends` (int64 end offset of every document) and `document_mask`, each window
    also carries segment ids (which document each input position belongs to, 0 for the first
    in the window): the model's attention then stays within a document and its positions
    restart at each. With a `loss_mask` (uint8 per token, prompt/response data), each window
    carries loss weights for its targets (see `loss_weights`)."""

    tokens: np.ndarray
    seq_len: int
    eval_fraction: float
    document_ends: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    document_mask: bool = False
    # --epochs: the train windows as one stream of epochs (none dropped at an epoch's end)
    stream: bool = False

    def __post_init__(self) -> None:
        self.n_windows = (len(self.tokens) - 1) // self.seq_len
        self.n_eval = int(self.n_windows * self.eval_fraction)
        self.n_train = self.n_windows - self.n_eval
        if self.n_train < 1 and not (self.eval_fraction == 1.0 and self.n_eval):
            raise UsageError(
                f"the corpus has {len(self.tokens)} tokens, too few for one window of "
                f"--seq-len {self.seq_len}; use a larger corpus or a shorter --seq-len"
            )
        if self.document_mask and self.document_ends is None:
            raise UsageError(
                "--document-mask on needs a corpus read record by record (JSONL, Parquet, "
                "Arrow), whose document boundaries are known; use --document-mask off"
            )

    @property
    def fields(self) -> tuple[str, ...]:
        """The keys of this corpus's batches."""
        return (
            ("inputs", "targets")
            + (("segments",) if self.document_mask else ())
            + (("weights",) if self.loss_mask is not None else ())
        )

    def rows(self, window_ids: np.ndarray) -> np.ndarray:
        """Windows [n, seq_len + 1] int32 for the given window ids."""
        return self.tokens[self._positions(window_ids)].astype(np.int32)

    def _positions(self, window_ids: np.ndarray) -> np.ndarray:
        starts = np.asarray(window_ids, dtype=np.int64)[:, None] * self.seq_len
        return starts + np.arange(self.seq_len + 1)

    def segments(self, window_ids: np.ndarray) -> np.ndarray:
        """int32 [n, seq_len]: the document of each input position, counted from the window's
        first (0). A document's end-of-text token belongs to the document it ends."""
        # made only where __post_init__ found document ends (--document-mask on)
        assert self.document_ends is not None
        positions = self._positions(window_ids)[:, :-1]
        documents = np.searchsorted(self.document_ends, positions, side="right")
        return (documents - documents[:, :1]).astype(np.int32)

    def target_mask(self, window_ids: np.ndarray) -> np.ndarray:
        """float32 [n, seq_len]: 1 where the loss counts the target (all ones without a mask)."""
        if self.loss_mask is None:
            return np.ones((len(window_ids), self.seq_len), np.float32)
        return self.loss_mask[self._positions(window_ids)[:, 1:]].astype(np.float32)

    def loss_weights(self, window_ids: np.ndarray) -> np.ndarray:
        """float32 [n, seq_len]: the loss mask of the targets scaled so that the mean of
        weight x token loss over these windows is the mean loss of the counted tokens (see
        `normalized`)."""
        return normalized(self.target_mask(window_ids))

    def batch_rows(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The per-row batch arrays of these windows except "weights" (which are normalized
        over the whole global batch): inputs, targets and, with a document mask, segments."""
        rows = self.rows(window_ids)
        local = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
        if self.document_mask:
            local["segments"] = self.segments(window_ids)
        return local

    def batch_at(
        self, seed: int, step: int, global_batch_size: int, sharding: jax.sharding.Sharding
    ) -> dict[str, jax.Array]:
        """The global train batch of data step `step` (0-based)."""
        ids = train_window_ids(seed, step, global_batch_size, self.n_train, self.stream)
        return global_batch(self, ids, sharding)


def normalized(mask: np.ndarray) -> np.ndarray:
    """mask x (mask.size / mask.sum()): the mean of weight x token loss is then the mean loss
    over the counted tokens, and, being a plain mean, it splits exactly over devices and
    accumulation micro-batches. All zero when nothing counts."""
    counted = mask.sum()
    return mask * (mask.size / counted) if counted else mask


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, n_train: int) -> np.ndarray:
    """The permutation of range(n_train) that epoch `epoch` visits, drawn from (seed, epoch).
    Cached: every step of an epoch slices the same permutation."""
    order = np.random.default_rng([seed, epoch]).permutation(n_train)
    order.flags.writeable = False
    return order


def train_window_ids(
    seed: int, step: int, global_batch: int, n_train: int, stream: bool = False
) -> np.ndarray:
    """The train window ids of optimizer step `step` (0-based): a slice of epoch e's permutation
    of range(n_train). Windows left over at an epoch's end are skipped; with `stream` (--epochs)
    none is: the epochs' permutations follow each other as one sequence, step t takes its
    positions [t * batch, (t + 1) * batch), and a step may straddle two epochs."""
    steps_per_epoch = n_train // global_batch
    if steps_per_epoch < 1:
        raise UsageError(
            f"--batch {global_batch} is larger than the {n_train} training windows of the "
            f"corpus; use a smaller --batch or --seq-len, or more data"
        )
    if stream:
        return stream_ids(seed, step * global_batch + np.arange(global_batch), n_train)
    epoch, within = divmod(step, steps_per_epoch)
    return epoch_order(seed, epoch, n_train)[within * global_batch : (within + 1) * global_batch]


def stream_ids(seed: int, positions: np.ndarray, n_train: int) -> np.ndarray:
    """The window ids at `positions` of the stream of epochs (epoch e's permutation from
    position e * n_train on)."""
    epochs, within = np.divmod(positions, n_train)
    ids = np.empty(len(positions), np.int64)
    for epoch in np.unique(epochs):
        ids[epochs == epoch] = epoch_order(seed, int(epoch), n_train)[within[epochs == epoch]]
    return ids


def data_step(step: int, skipped: list[int]) -> int:
    """The data step (0-based, the `step` of train_window_ids) that optimizer step `step`
    (1-based) reads: step - 1, moved past every data step in `skipped` (ascending; the windows a
    rollback skips, spmd.training.divergence). The order stays a function of (seed, step, skipped),
    and `skipped` is saved with every checkpoint, so a resume reads the same windows."""
    position = step - 1
    for skipped_step in skipped:
        if skipped_step > position:
            break
        position += 1
    return position


def eval_window_ids(batch_index: int, global_batch: int, windows: TokenWindows) -> np.ndarray:
    """Eval windows of eval batch `batch_index`: consecutive held-out windows, wrapping."""
    offsets = (batch_index * global_batch + np.arange(global_batch)) % max(windows.n_eval, 1)
    return windows.n_train + offsets if windows.n_eval else offsets


def process_row_ranges(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> list[tuple[int, int]]:
    """The [start, stop) row ranges of a global array of `shape` that this process's devices
    hold under `sharding`, ascending and without repeats (replicas share a range). Taken from
    the devices, not the process index: device order need not follow process order."""
    ranges = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0] if index else slice(None)
        ranges.add(rows.indices(shape[0])[:2])
    return sorted(ranges)


def global_batch(
    windows: TokenWindows, window_ids: np.ndarray, sharding: jax.sharding.Sharding
) -> dict[str, jax.Array]:
    """{"inputs", "targets"} and, as the corpus has them, "segments" (int32) and "weights"
    (float32): [len(window_ids), seq_len] global arrays with `sharding`.

    This process reads only the windows of the rows its devices hold (the loss weights'
    normalization reads the mask of every row: one byte per token)."""
    shape = (len(window_ids), windows.seq_len)
    rows = local_rows(sharding, shape)
    local = windows.batch_rows(np.asarray(window_ids)[rows])
    if "weights" in windows.fields:
        local["weights"] = windows.loss_weights(window_ids)[rows]
    return put_local(local, sharding, shape)


def local_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> np.ndarray:
    """The global row indices this process's devices hold, ascending."""
    ranges = process_row_ranges(sharding, shape)
    return np.concatenate([np.arange(start, stop) for start, stop in ranges])


def put_local(
    local: dict[str, np.ndarray], sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> dict[str, jax.Array]:
    """Global arrays of `shape` from this process's rows (`local_rows` order)."""
    return {
        key: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(value), shape)
        for key, value in local.items()
    }


# What decides the data order; a resumed run must agree on all of them.
ORDER_FIELDS = ("seed", "batch", "seq_len", "eval_fraction", "fingerprint")


def data_state(
    step: int, seed: int, batch: int, seq_len: int, eval_fraction: float, fingerprint: str
) -> dict[str, Any]:
    """The sampler's whole state after `step` optimizer steps, as JSON-ready values."""
    return {
        "step": step,
        "seed": seed,
        "batch": batch,
        "seq_len": seq_len,
        "eval_fraction": eval_fraction,
        "fingerprint": fingerprint,
    }


def check_same_order(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """UsageError unless a run with data state `current` continues `saved`'s data order."""
    for key in ORDER_FIELDS:
        if saved.get(key) == current[key]:
            continue
        if key == "fingerprint":
            raise UsageError(
                f"the data differs from the data the checkpoint was trained on (token "
                f"fingerprint {saved.get(key)} there, {current[key]} here); resume with the same "
                f"--data and --tokenizer"
            )
        flag = "--" + key.replace("_", "-")
        raise UsageError(
            f"{flag} {current[key]} differs from the checkpoint's {saved.get(key)}, which would "
            f"change the data order; resume with {flag} {saved.get(key)}"
        )
