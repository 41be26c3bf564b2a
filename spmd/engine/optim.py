"""What an optimizer is (`Optimizer`, the record an entry of spmd.engine.optimizers fills in)
and what every optimizer shares: the checks of its numbers, the LR schedule (linear warm-up,
then cosine, linear, constant or warm-up-stable-decay, joined from optax's own schedules), the
linear LR scaling rule, weight decay's mask (matrices only) and global-norm clipping."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from spmd.errors import UsageError
from spmd.parallel.collectives import global_norm
from spmd.sections import OptimizerConfig, choices

LR_SCALINGS = choices(OptimizerConfig, "lr_scaling")
LR_SCHEDULES = choices(OptimizerConfig, "lr_schedule")


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An update rule that --optimizer names: how it is made, and the state it keeps.

    `make` gets the run's optimizer section, the LR schedule (by optimizer count) and each
    trained param's logical axis names, which say which params it treats how (AdamW decays
    matrices only, `decay_mask`; an optimizer for matrices alone would hand the others to
    another rule inside its `make`). It returns the update before clipping, which
    spmd.engine.optimizers.make_optimizer puts in front. The update runs on the fp32 master
    weights (spmd.engine.precision), so its state is fp32."""

    name: str
    make: Callable[[OptimizerConfig, optax.Schedule, Any], optax.GradientTransformation]
    # values of state it keeps per trained param, each in the master weights' dtype (AdamW's
    # two moments: 2), beside the master copy: what the planner counts per param
    # (spmd.estimate.memory) and tests/test_optimizers.py checks against what optax allocates
    state_slots: int
    # the values it keeps per param of a hidden matrix instead, where it treats those apart
    # (Muon: one momentum there, AdamW's two moments elsewhere); None: state_slots everywhere
    matrix_state_slots: int | None = None
    # True when each param's update reads only that param's own elements (AdamW, Lion, SGD):
    # then a device may update its slice of a param alone (spmd.engine.explicit under ZeRO).
    # False for a rule over whole matrices (Muon's orthogonalisation).
    elementwise: bool = True
    # the OptimizerConfig fields that only this optimizer reads (its flags): set with another
    # --optimizer they are refused (spmd.engine.optimizers.check_fields), never ignored
    fields: tuple[str, ...] = ()
    # FLOPs of one update that the planner counts beside the model's (a function of the
    # model's spmd.model_shape.ModelShape: Muon's Newton-Schulz matmuls); None: elementwise
    # work, not counted
    update_flops: Callable[[Any], float] | None = None
    # values of state per trained param that depend on the matrices' shapes (Adafactor's
    # factored moments: m + n per m x n matrix), a function of the planner's
    # spmd.estimate.cost.Setup, which the planner counts instead of the slots; None: the slots
    state_values: Callable[[Any], float] | None = None
    # more checks of the run's optimizer section when this optimizer is chosen (UsageError),
    # e.g. schedule-free AdamW's refusal of a decaying LR schedule
    check: Callable[[OptimizerConfig], None] | None = None
    # (master weights, the optimizer's own state) -> the params to evaluate, sample and export,
    # for an optimizer that trains other params than those (schedule-free AdamW's average x);
    # None: the params themselves
    eval_params: Callable[[Any, Any], Any] | None = None
    # OptimizerConfig fields this optimizer sets where the user gave none (spmd.run.resolve):
    # schedule-free AdamW's constant LR schedule, which its average replaces the decay of
    defaults: tuple[tuple[str, Any], ...] = ()


def update_count(opt_state: Any) -> jax.Array | None:
    """The number of updates `opt_state` has applied (optax's `count`: the first one found,
    all of them advance together), or None for a state without one."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        last = path[-1] if path else None
        if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "count":
            return leaf
    return None


def check_number(flag: str, value: float, low: float, high: float, valid: str) -> None:
    """UsageError unless `value` is a finite number in [low, high] (NaN and infinities fail
    every comparison, so they are named here rather than slipping through one); `valid` says
    what would be valid, for the message."""
    if not (math.isfinite(value) and low <= value <= high):
        raise UsageError(f"{flag} {value:g} must be {valid}")


def check_hyperparameters(cfg: OptimizerConfig) -> None:
    """UsageError for an optimizer number that cannot train: NaN, infinite, negative or out of
    its range (a NaN LR would otherwise train to the end on NaN params)."""
    check_number("--lr", cfg.lr, math.ulp(0.0), math.inf, "a positive, finite learning rate")
    if cfg.warmup < 0:
        raise UsageError(f"--warmup {cfg.warmup} must be 0 or a positive number of steps")
    check_number("--min-lr-ratio", cfg.min_lr_ratio, 0.0, 1.0, "a fraction of --lr in [0, 1]")
    check_number(
        "--decay-fraction",
        cfg.decay_fraction,
        math.ulp(0.0),
        1.0,
        "a fraction of --steps in (0, 1]",
    )
    check_number("--weight-decay", cfg.weight_decay, 0.0, math.inf, "0 or a positive number")
    check_number("--grad-clip", cfg.grad_clip, 0.0, math.inf, "a positive norm, or 0 (off)")
    for flag, beta in (("--beta1", cfg.beta1), ("--beta2", cfg.beta2)):
        # beta = 1 would never forget the first moment, and its bias correction divides by 0.
        check_number(flag, beta, 0.0, 1.0 - math.ulp(1.0), "a decay rate in [0, 1)")
    # DiLoCo's outer SGD: checked whatever --dcn-sync is, so a bad value is never ignored
    check_number("--outer-lr", cfg.outer_lr, math.ulp(0.0), math.inf, "a positive, finite LR")
    check_number("--outer-momentum", cfg.outer_momentum, 0.0, 1.0 - math.ulp(1.0), "in [0, 1)")


def peak_lr(cfg: OptimizerConfig, global_batch: int) -> float:
    """The peak LR after the scaling rule: lr, or lr * global_batch / ref_batch for "linear"."""
    if cfg.lr_scaling not in LR_SCALINGS:
        raise UsageError(f"--lr-scaling {cfg.lr_scaling!r} is not one of {', '.join(LR_SCALINGS)}")
    if cfg.lr_scaling == "linear":
        if cfg.ref_batch <= 0:
            raise UsageError(f"--ref-batch {cfg.ref_batch} must be a positive batch size")
        return cfg.lr * global_batch / cfg.ref_batch
    return cfg.lr


def lr_schedule(cfg: OptimizerConfig, steps: int, global_batch: int) -> optax.Schedule:
    """The LR by optimizer count (the updates applied before this one: optimizer step t reads
    count t - 1) in a run of `steps` steps: 0 -> peak linearly over `warmup` counts, then
    --lr-schedule: cosine or linear decay to min_lr_ratio x peak, reached at count `steps`
    (after the last step); constant at peak; wsd at peak, then linear decay to min_lr_ratio x
    peak over the last `wsd_decay_steps` counts. A function of the count alone, which the
    optimizer state holds, so resumes and rollbacks continue it. UsageError for a WSD decay
    that does not fit after the warm-up."""
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise UsageError(
            f"--lr-schedule {cfg.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}"
        )
    peak = peak_lr(cfg, global_batch)
    end = peak * cfg.min_lr_ratio
    warmup = min(cfg.warmup, max(steps - 1, 0))  # a run shorter than its warm-up still decays
    decay = max(steps, warmup + 1) - warmup  # counts from the warm-up's end to the run's
    boundaries = [warmup]
    if cfg.lr_schedule == "cosine":  # as optax.warmup_cosine_decay_schedule, bit for bit
        alpha = end / peak if peak else 0.0
        after_warmup = [optax.cosine_decay_schedule(peak, decay, alpha=alpha)]
    elif cfg.lr_schedule == "linear":
        after_warmup = [optax.linear_schedule(peak, end, decay)]
    elif cfg.lr_schedule == "constant":
        after_warmup = [optax.constant_schedule(peak)]
    else:  # wsd
        final = wsd_decay_steps(cfg, steps)
        if cfg.warmup + final > steps:
            raise UsageError(
                f"--lr-schedule wsd: --warmup {cfg.warmup} plus the {final} decay steps "
                f"(--decay-fraction {cfg.decay_fraction:g} of --steps {steps}) exceed --steps "
                f"{steps}; lower --warmup or --decay-fraction"
            )
        after_warmup = [optax.constant_schedule(peak), optax.linear_schedule(peak, end, final)]
        boundaries.append(steps - final)
    warm = optax.linear_schedule(0.0, peak, warmup)
    return optax.join_schedules([warm, *after_warmup], boundaries)


def wsd_decay_steps(cfg: OptimizerConfig, steps: int) -> int:
    """The optimizer steps of WSD's final decay: decay_fraction of `steps`, rounded, at least 1."""
    return max(1, round(cfg.decay_fraction * steps))


def decay_mask(names_tree: Any) -> Any:
    """True for params that get weight decay: those with two or more non-`layers` dims
    (matrices and embeddings); norms and biases are exempt."""
    return jax.tree.map(
        lambda names: sum(n != "layers" for n in names) >= 2,
        names_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm (same math, same empty state), but with the norm of
    spmd.parallel.collectives.global_norm, which stays exact on the local shards of a shard_map."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        norm = global_norm(updates)
        keep = norm < max_norm
        return jax.tree.map(
            lambda g: jnp.where(keep, g, g / norm.astype(g.dtype) * max_norm), updates
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def adamw(
    cfg: OptimizerConfig, lr: optax.Schedule, names_tree: Any
) -> optax.GradientTransformation:
    """AdamW (optax's) with decoupled weight decay on matrices only (`decay_mask`)."""
    return optax.adamw(
        lr,
        b1=cfg.beta1,
        b2=cfg.beta2,
        eps=1e-8,
        weight_decay=cfg.weight_decay,
        mask=decay_mask(names_tree),
    )


# The default: the first and second moments of each param (2 fp32 values per param).
ADAMW = Optimizer(name="adamw", make=adamw, state_slots=2)
