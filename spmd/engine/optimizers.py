"""The registry of optimizers: one line per optimizer, the lookup by the name --optimizer
gives, and the run's optax chain built from the entry (spmd.engine.optim says what an
optimizer is; docs/extending.md how to add one). The builder makes a run's optimizer here and
the planner (spmd.estimate.memory) counts its state from the same entry, so the planner knows
no optimizer the engine cannot build.

    optimizers.get("adamw")                 the entry (UsageError naming the valid ones)
    optimizers.check_fields(cfg)            UsageError for another optimizer's flag
    optimizers.make_optimizer(cfg, ...)     clipping, then the entry's update on the schedule
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from spmd.engine import adafactor, lion, muon, schedule_free, sgd
from spmd.engine.optim import ADAMW, Optimizer, check_number, clip_by_global_norm, lr_schedule
from spmd.errors import UsageError
from spmd.sections import OptimizerConfig

# The registry: one line per optimizer.
OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        ADAMW,
        sgd.MOMENTUM,
        sgd.SGD,
        lion.LION,
        muon.MUON,
        adafactor.ADAFACTOR,
        schedule_free.SCHEDULE_FREE_ADAMW,
    )
}


def get(name: str) -> Optimizer:
    """The optimizer called `name`; UsageError naming the valid ones otherwise."""
    if name not in OPTIMIZERS:
        raise UsageError(f"--optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def check_resume(name: str, saved: dict[str, Any], where: str) -> None:
    """UsageError unless a checkpoint whose saved config's fields are `saved` (flat) holds the
    state of optimizer `name`: another optimizer's state has other leaves, and the line names
    the flag that resumes it. `where` names the checkpoint (its step and folder)."""
    theirs = saved.get("optimizer", ADAMW.name)  # saved before --optimizer: AdamW, the only one
    if theirs != name:
        raise UsageError(
            f"{where} holds the state of --optimizer {theirs}, not this run's {name}; resume it "
            f"with --optimizer {theirs}, or start a new run"
        )


def state_bytes(name: str, value_bytes: int, matrix_share: float = 0.0, setup: Any = None) -> float:
    """Bytes of state optimizer `name` keeps per trained param, beside the master copy, when
    each of its values takes `value_bytes` (the master weights' dtype) and `matrix_share` of
    the trained params are hidden matrices (which an optimizer with `matrix_state_slots`
    treats apart): what the planner counts, the mean over the params. An entry with
    `state_values` counts them from the planner's `setup` (spmd.estimate.cost.Setup) instead."""
    entry = get(name)
    if entry.state_values is not None and setup is not None:
        return entry.state_values(setup) * value_bytes
    if entry.matrix_state_slots is None or matrix_share == 0:
        return entry.state_slots * value_bytes  # whole bytes: an int, printed as one
    matrices = matrix_share * entry.matrix_state_slots
    return (matrices + (1.0 - matrix_share) * entry.state_slots) * value_bytes


def check_fields(cfg: OptimizerConfig) -> None:
    """UsageError for a flag of another optimizer than --optimizer's, set away from its
    default (a Muon flag with AdamW would otherwise be ignored), and for bad values of the
    chosen optimizer's own flags."""
    chosen = get(cfg.optimizer)
    defaults = OptimizerConfig()
    for entry in OPTIMIZERS.values():
        for field in entry.fields:
            if entry is not chosen and getattr(cfg, field) != getattr(defaults, field):
                flag = "--" + field.replace("_", "-")
                raise UsageError(
                    f"{flag} is --optimizer {entry.name}'s; this run's --optimizer is "
                    f"{cfg.optimizer} (drop {flag}, or use --optimizer {entry.name})"
                )
    for flag, beta in (
        ("--lion-beta1", cfg.lion_beta1),
        ("--lion-beta2", cfg.lion_beta2),
        ("--muon-momentum", cfg.muon_momentum),
    ):
        check_number(flag, beta, 0.0, 1.0 - math.ulp(1.0), "a decay rate in [0, 1)")
    if cfg.muon_ns_steps < 1:
        raise UsageError(f"--muon-ns-steps {cfg.muon_ns_steps} must be 1 or more iterations")
    check_number("--muon-rms", cfg.muon_rms, 0.0, math.inf, "0 (unscaled) or a positive RMS")
    if cfg.adafactor_min_dim < 1:
        raise UsageError(
            f"--adafactor-min-dim {cfg.adafactor_min_dim} must be 1 or more (a matrix side)"
        )
    if chosen.check is not None:
        chosen.check(cfg)


def make_optimizer(
    cfg: OptimizerConfig, steps: int, global_batch: int, names_tree: Any
) -> optax.GradientTransformation:
    """Clip by global norm (if grad_clip > 0), then optimizer `cfg.optimizer` on the schedule
    of a run of `steps` optimizer steps of `global_batch` sequences; `names_tree` holds each
    param's logical axis names (they decide weight decay)."""
    update = get(cfg.optimizer).make(cfg, lr_schedule(cfg, steps, global_batch), names_tree)
    if cfg.grad_clip > 0:
        return optax.chain(clip_by_global_norm(cfg.grad_clip), update)
    return update


def with_sign_rule(tx: optax.GradientTransformation | Any, leaf: str, rate: float) -> Any:
    """names -> `tx` (or `tx(names)`) with the params whose last key is `leaf` updated by
    -rate x sign(their gradient) instead: outside the clipping, the schedule, the weight decay
    and the optimizer's moments (which see a zero gradient for them, so the state keeps its
    structure and a checkpoint its layout). What an MoE's router_bias_rate asks: the bias's
    gradient is the load minus its mean (models.moe_routing.load_feedback), so the step is
    DeepSeek-V3's bias += rate x sign(mean load - load)."""

    def make(names: Any) -> optax.GradientTransformation:
        inner = tx if isinstance(tx, optax.GradientTransformation) else tx(names)
        chosen = jax.tree_util.tree_map_with_path(
            lambda path, _: getattr(path[-1], "key", None) == leaf,
            names,
            is_leaf=lambda x: isinstance(x, tuple),
        )

        def signed(update: jax.Array, grad: jax.Array, selected: bool) -> jax.Array:
            return (-rate * jnp.sign(grad)).astype(update.dtype) if selected else update

        def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
            rest = jax.tree.map(lambda g, c: jnp.zeros_like(g) if c else g, grads, chosen)
            updates, state = inner.update(rest, state, params)
            return jax.tree.map(signed, updates, grads, chosen), state

        return optax.GradientTransformation(inner.init, update)

    return make
