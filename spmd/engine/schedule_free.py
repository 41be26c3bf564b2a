"""Schedule-free AdamW (optax.contrib.schedule_free_adamw; Defazio et al. 2024, "The Road Less
Scheduled"): no LR decay; the gradient is taken at y, an interpolation between the base
AdamW-without-momentum iterate z and their running average x, and x is the model to evaluate.

The train state's params are y (what the step differentiates); the optimizer state holds z,
AdamW's second moment and the averaging's scalars (its b1, the weight sum, the largest LR so
far), so y and that state are all a resume needs, bitwise. The params to evaluate, sample and
export are x = (y - (1 - b1) z) / b1 (optax.contrib.schedule_free_eval_params), computed when
asked (`averaged`): the evals and the samples read them, and a checkpoint holds them beside the
state as "eval_params", which spmd.convert's exports and spmd.generate read instead of y.

It is optax's schedule_free_adamw, with the weight decay on matrices only (`decay_mask`), as
spmd's AdamW: schedule_free over scale_by_rms (--beta2, Adam's bias correction, eps outside the
root), decoupled weight decay and the LR; --beta1 is the interpolation's b1. The LR is the
run's schedule: its warm-up, then constant; a decaying schedule (cosine, linear, wsd) is
refused, as its authors replace the decay by the average. State: z and the second moment, 2
fp32 values per param, elementwise (ZeRO shards them as AdamW's moments)."""

from __future__ import annotations

from typing import Any

import jax
import optax
from optax.contrib import ScheduleFreeState

from spmd.engine.optim import Optimizer, decay_mask
from spmd.errors import UsageError
from spmd.sections import OptimizerConfig


def schedule_free_adamw(
    cfg: OptimizerConfig, lr: optax.Schedule, names_tree: Any
) -> optax.GradientTransformation:
    """optax's schedule_free_adamw on the run's (constant after warm-up) schedule, b1 --beta1,
    b2 --beta2, decoupled weight decay on matrices only."""
    base = optax.chain(
        optax.scale_by_rms(decay=cfg.beta2, eps=1e-8, eps_in_sqrt=False, bias_correction=True),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask(names_tree)),
        optax.scale_by_learning_rate(lr),
    )
    return optax.contrib.schedule_free(base, lr, b1=cfg.beta1)


def averaged(params: Any, opt_state: Any) -> Any:
    """x, the params to evaluate, of the trained params y `params` (the master weights) and the
    optimizer's own state `opt_state` (its ScheduleFreeState, wherever the chain nests it)."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleFreeState))
        if isinstance(s, ScheduleFreeState)
    ]
    return optax.contrib.schedule_free_eval_params(found[0], params)


def check(cfg: OptimizerConfig) -> None:
    """UsageError for an LR schedule that decays, given by the user (without one the run takes
    `defaults`' constant): schedule-free replaces the decay."""
    if cfg.lr_schedule != "constant":
        raise UsageError(
            f"--lr-schedule {cfg.lr_schedule} decays the LR, which --optimizer "
            f"schedule-free-adamw replaces by its average: use --lr-schedule constant (the "
            f"--warmup still applies)"
        )
    if cfg.beta1 == 0:
        raise UsageError("--beta1 0 must be above 0 with --optimizer schedule-free-adamw")


SCHEDULE_FREE_ADAMW = Optimizer(
    name="schedule-free-adamw",
    make=schedule_free_adamw,
    state_slots=2,  # z and the second moment
    check=check,
    eval_params=averaged,
    defaults=(("lr_schedule", "constant"),),
)
