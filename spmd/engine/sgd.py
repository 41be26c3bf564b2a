"""Stochastic gradient descent, plain and with heavy-ball momentum (optax.sgd): the cheapest
optimizers in state, 0 and 1 fp32 value per param. Weight decay is added to the gradient of
matrices only (`decay_mask`) before the LR scales it, so each step shrinks a matrix by
lr x weight_decay, as AdamW's decoupled decay does."""

from __future__ import annotations

from typing import Any

import optax

from spmd.engine.optim import Optimizer, decay_mask
from spmd.sections import OptimizerConfig


def sgd(cfg: OptimizerConfig, lr: optax.Schedule, names_tree: Any) -> optax.GradientTransformation:
    """SGD without momentum: no state but optax's step count."""
    return optax.chain(
        optax.add_decayed_weights(cfg.weight_decay, decay_mask(names_tree)), optax.sgd(lr)
    )


def momentum(
    cfg: OptimizerConfig, lr: optax.Schedule, names_tree: Any
) -> optax.GradientTransformation:
    """SGD with heavy-ball momentum --beta1: one running sum of gradients per param."""
    return optax.chain(
        optax.add_decayed_weights(cfg.weight_decay, decay_mask(names_tree)),
        optax.sgd(lr, momentum=cfg.beta1),
    )


SGD = Optimizer(name="sgd", make=sgd, state_slots=0)
MOMENTUM = Optimizer(name="momentum", make=momentum, state_slots=1)
