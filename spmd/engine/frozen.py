"""Frozen params: a model whose state has a top-level `frozen` subtree (a LoRA model's base,
models/lora.py) is trained in everything else only. The engine differentiates, reduces and
optimizes the trainable part alone: the frozen params get no gradients, no optimizer state
and no master copy (they stay in the policy's working dtype), and pass through each step
unchanged.

Pure dicts of params (or of their names, shapes, shardings) are split by their top-level key:
`split(tree)` -> (trainable, frozen or None), `join(trainable, frozen)` back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FROZEN = "frozen"  # the top-level key of the params the engine does not train


def has_frozen(tree: Any) -> bool:
    """Whether `tree` (a pure dict of a model's params, names, ...) has a frozen part."""
    return isinstance(tree, dict) and FROZEN in tree


def split(tree: Any) -> tuple[Any, Any]:
    """(the trainable part, the frozen part or None) of `tree`."""
    if not has_frozen(tree):
        return tree, None
    return {k: v for k, v in tree.items() if k != FROZEN}, tree[FROZEN]


def trainable(tree: Any) -> Any:
    """The trainable part of `tree` (all of it when nothing is frozen)."""
    return split(tree)[0]


def join(trainable_part: Any, frozen_part: Any) -> Any:
    """`split`'s inverse."""
    return trainable_part if frozen_part is None else {**trainable_part, FROZEN: frozen_part}


def bind(loss: Callable, frozen_part: Any) -> Callable:
    """`loss(params, batch)` as a function of the trainable params alone, the frozen ones held
    fixed (constants to differentiation: no gradient is taken of them)."""
    if frozen_part is None:
        return loss

    def trainable_loss(params: Any, batch: Any) -> Any:
        return loss(join(params, frozen_part), batch)

    return trainable_loss
