"""Preference pairs as batches: each record's chosen and rejected sequence in rows 2i and 2i + 1
of a global batch, one sequence per row, so nothing leaks across documents.

A pair corpus is read as prompt/response documents, chosen then rejected (spmd.io.corpora);
its token file holds them end to end with their document ends and a loss mask that is 1 on
each response (and its end token). A row is one document's first seq_len + 1 tokens (longer
ones are cut at the end, a prompt longer than the row leaves no response token to count),
padded with token 0 whose mask is 0; batch["response"] marks the targets that are response
tokens (int32 0/1, as every key but "weights" is; not normalized: the preference objectives
sum over them, spmd.engine.preference_loss).

The sampler is spmd.io.data's over pairs: step t of the run takes pairs [t * batch / 2,
(t + 1) * batch / 2) of each epoch's permutation of the train pairs, drawn from (seed, epoch),
so a resumed run continues its order; the last `eval_fraction` of the pairs is held out, an
even count of documents, so eval batches (spmd.io.data.eval_window_ids) hold whole pairs too.

Under --dpo-precompute-reference the batches also carry batch[REFERENCE_CACHE]: each row's
reference log-prob (computed once by spmd.reference_cache, held in `reference`) at the row's
first position, float32.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from spmd.errors import UsageError
from spmd.io import data
from spmd.sections import PAIRS, REFERENCE_CACHE


@dataclasses.dataclass
class PairWindows:
    """Pair rows over a token file: window 2i is pair i's chosen document, 2i + 1 its rejected
    one (`document_ends`: int64 end offset of every document; `loss_mask`: uint8 per token)."""

    tokens: np.ndarray
    document_ends: np.ndarray
    loss_mask: np.ndarray
    seq_len: int
    eval_fraction: float
    document_mask: bool = False  # (one document per row: no segment ids)
    stream: bool = False  # --epochs: the pairs as one stream of epochs (spmd.io.data)
    # --dpo-precompute-reference: batches carry REFERENCE_CACHE, each row's reference log-prob
    # from `reference` (float32 [n_windows], spmd.reference_cache fills it before training)
    cached_reference: bool = False
    reference: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.document_ends) % 2:  # a document the tokenizer made empty was dropped
            raise UsageError(
                f"--data holds {len(self.document_ends)} sequences, not whole pairs: a record's "
                f"prompt and response tokenized to nothing; drop it from the data"
            )
        n_pairs = len(self.document_ends) // 2
        if n_pairs < 1:
            raise UsageError("--data holds no preference pair; give records with both responses")
        eval_pairs = int(n_pairs * self.eval_fraction)
        self.n_pairs = n_pairs
        self.n_windows = 2 * n_pairs
        self.n_eval = 2 * eval_pairs
        self.n_train = self.n_windows - self.n_eval
        if self.n_train < 2 and not (self.eval_fraction == 1.0 and self.n_eval):
            raise UsageError(
                f"--eval-fraction {self.eval_fraction} holds out all {n_pairs} preference "
                f"pairs; lower it or give more pairs"
            )
        self.starts = np.concatenate([[0], self.document_ends[:-1]]).astype(np.int64)

    @property
    def fields(self) -> tuple[str, ...]:
        """The keys of a pair corpus's batches."""
        return ("inputs", "targets", PAIRS) + ((REFERENCE_CACHE,) if self.cached_reference else ())

    def rows(self, window_ids: np.ndarray) -> np.ndarray:
        """int32 [n, seq_len + 1]: each given document from its start, 0 past its end."""
        ids = np.asarray(window_ids, np.int64)
        offsets = self.starts[ids][:, None] + np.arange(self.seq_len + 1)
        inside = offsets < self.document_ends[ids][:, None]
        return np.where(inside, self.tokens[np.where(inside, offsets, 0)], 0).astype(np.int32)

    def target_mask(self, window_ids: np.ndarray) -> np.ndarray:
        """int32 [n, seq_len]: 1 where a target is a response token (0 past the end)."""
        ids = np.asarray(window_ids, np.int64)
        offsets = self.starts[ids][:, None] + np.arange(1, self.seq_len + 1)
        inside = offsets < self.document_ends[ids][:, None]
        return np.where(inside, self.loss_mask[np.where(inside, offsets, 0)], 0).astype(np.int32)

    def batch_rows(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        """inputs, targets and the response mask (0/1), int32 [n, seq_len], of the given
        documents."""
        rows = self.rows(window_ids)
        out = {"inputs": rows[:, :-1], "targets": rows[:, 1:], PAIRS: self.target_mask(window_ids)}
        if self.cached_reference:
            if self.reference is None:
                raise RuntimeError("the reference log-probs are read before they were computed")
            cache = np.zeros((len(rows), self.seq_len), np.float32)
            cache[:, 0] = self.reference[np.asarray(window_ids, np.int64)]
            out[REFERENCE_CACHE] = cache
        return out

    def role(self, window: int) -> str:
        """What row `window` is: "pair P chosen" or "pair P rejected" (P counted from 0)."""
        return f"pair {window // 2} {'rejected' if window % 2 else 'chosen'}"

    def train_rows(self, seed: int, count: int) -> np.ndarray:
        """The first `count` rows training reads, in order (the first epoch's pairs)."""
        order = data.epoch_order(seed, 0, self.n_train // 2)
        return np.stack([2 * order, 2 * order + 1], axis=1).reshape(-1)[:count]

    def batch_at(
        self, seed: int, step: int, global_batch_size: int, sharding: jax.sharding.Sharding
    ) -> dict[str, jax.Array]:
        """The global train batch of data step `step` (0-based): global_batch_size / 2 pairs,
        each chosen row before its rejected one."""
        pairs = self.n_train // 2
        pair_ids = data.train_window_ids(seed, step, global_batch_size // 2, pairs, self.stream)
        ids = np.stack([2 * pair_ids, 2 * pair_ids + 1], axis=1).reshape(-1)  # pairs stay whole
        return data.global_batch(self, ids, sharding)  # type: ignore[arg-type]
