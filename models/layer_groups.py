"""Layer groups: a decoder whose layers are of two kinds (an MoE's dense-MLP layers before or
between its sparse ones: DeepSeek-V3's `first_k_dense_replace`, Qwen3-MoE's `mlp_only_layers`)
holds each kind as its own stack, and runs the layers in model order as runs of one kind, each
run a scan over its rows of its stack.

    dense_layer_set("0-2,9", 12)      -> (0, 1, 2, 9): the layers with a dense MLP
    runs((0, 1, 2, 9), 12)            -> [Run(True, 0, 3, 0), Run(False, 0, 6, 3),
                                          Run(True, 3, 1, 9), Run(False, 6, 2, 10)]
    rows(stack_state, run)            -> the run's rows of a stacked nnx.State

A layer's place in its stack is its rank among the layers of its kind, so a stack holds its
layers in model order and a checkpoint's layer i is found from the set alone (models/
hf_tensors.py numbers the Hugging Face tensors by it). The set is stated by one config field,
a text (a flag's value): comma-separated layer indices and inclusive ranges, "" for none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from spmd.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive layers of one kind: `count` rows of its stack from row `start`, the first
    being layer `first` of the model."""

    dense: bool  # the dense-MLP stack's rows, or the sparse (experts) stack's
    start: int  # first row in its stack
    count: int  # layers
    first: int  # the model's index of its first layer


def dense_layer_set(text: str, n_layers: int, flag: str = "--dense-layers") -> tuple[int, ...]:
    """The sorted layer indices `text` names ("0-2,9": 0, 1, 2 and 9); UsageError naming the
    value unless each is an index below `n_layers`, ranges run upward and not every layer is
    named (a model without experts is --n-experts 0)."""
    found: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise UsageError(
                f"{flag} {text!r}: {part!r} is not a layer index or a range like 0-2"
            ) from None
        if not 0 <= first <= last < n_layers:
            raise UsageError(
                f"{flag} {text!r}: {part!r} must name layers from 0 to {n_layers - 1} (n_layers "
                f"{n_layers}), a range low-high with low <= high"
            )
        found.update(range(first, last + 1))
    if len(found) == n_layers:
        raise UsageError(
            f"{flag} {text!r} makes every one of the {n_layers} layers dense; a model without "
            f"experts is --n-experts 0"
        )
    return tuple(sorted(found))


def layer_text(layers: tuple[int, ...] | list[int]) -> str:
    """The text of a set of layer indices, its consecutive ones as ranges ((0, 1, 2, 9):
    "0-2,9"): what dense_layer_set reads back."""
    parts: list[tuple[int, int]] = []
    ordered = sorted(set(layers))
    for i, layer in enumerate(ordered):
        if i and layer == ordered[i - 1] + 1:
            parts[-1] = (parts[-1][0], layer)
        else:
            parts.append((layer, layer))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def runs(dense: tuple[int, ...], n_layers: int) -> list[Run]:
    """The model's layers in order as runs of one kind (the module docstring's example)."""
    out: list[Run] = []
    rows = {True: 0, False: 0}  # next row of each stack
    for layer in range(n_layers):
        kind = layer in dense
        if out and out[-1].dense == kind:
            out[-1] = dataclasses.replace(out[-1], count=out[-1].count + 1)
        else:
            out.append(Run(kind, rows[kind], 1, layer))
        rows[kind] += 1
    return out


def stack_layers(dense: tuple[int, ...], n_layers: int, of_dense: bool) -> list[int]:
    """The model's index of each row of one stack (the dense one's, or the sparse one's)."""
    return [layer for layer in range(n_layers) if (layer in dense) == of_dense]


def rows(stacked: Any, run: Run, total: int) -> Any:
    """`stacked` (arrays or an nnx.State with a leading layers dim of `total`) cut to the
    run's rows; the whole stack, uncut, where the run is all of it (no copy in the program)."""
    if run.start == 0 and run.count == total:
        return stacked
    return jax.tree.map(lambda a: a[run.start : run.start + run.count], stacked)


def dense_of(cfg: Any) -> tuple[int, ...]:
    """The dense-MLP layers of a model config (none for a family without layer groups)."""
    dense_layer_set = getattr(cfg, "dense_layer_set", None)
    return dense_layer_set() if dense_layer_set is not None else ()
