"""Lion (optax.lion, Chen et al. 2023): the sign of a mix of the momentum and the gradient,
so every update element is +-lr (before weight decay). One fp32 momentum per param, half of
AdamW's state, and elementwise, so exact on ZeRO's slices. Its LR is usually 3-10x below
AdamW's (a sign step is larger than Adam's normalised one); weight decay is decoupled,
lr x weight_decay per step, on matrices only (`decay_mask`), as AdamW's."""

from __future__ import annotations

from typing import Any

import optax

from spmd.engine.optim import Optimizer, decay_mask
from spmd.sections import OptimizerConfig


def lion(cfg: OptimizerConfig, lr: optax.Schedule, names_tree: Any) -> optax.GradientTransformation:
    """Lion with --lion-beta1 (the gradient's share in the sign) and --lion-beta2 (the
    momentum's decay)."""
    return optax.lion(
        lr,
        b1=cfg.lion_beta1,
        b2=cfg.lion_beta2,
        weight_decay=cfg.weight_decay,
        mask=decay_mask(names_tree),
    )


LION = Optimizer(name="lion", make=lion, state_slots=1, fields=("lion_beta1", "lion_beta2"))
