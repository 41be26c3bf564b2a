"""The registry of optimizers: one line per optimizer, the lookup by the name --optimizer
gives, and the run's optax chain built from the entry (spmd.engine.optim says what an
optimizer is; docs/extending.md how to add one). The builder makes a run's optimizer here and
the planner (spmd.estimate.memory) counts its state from the same entry, so the planner knows
no optimizer the engine cannot build.

    optimizers.get("adamw")                 the entry (UsageError naming the valid ones)
    optimizers.make_optimizer(cfg, ...)     clipping, then the entry's update on the schedule
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from spmd.engine import sgd
from spmd.engine.optim import ADAMW, Optimizer, clip_by_global_norm, lr_schedule
from spmd.errors import UsageError
from spmd.sections import OptimizerConfig

# The registry: one line per optimizer.
OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (ADAMW, sgd.MOMENTUM, sgd.SGD)}


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


def state_bytes(name: str, value_bytes: int) -> int:
    """Bytes of state optimizer `name` keeps per trained param, beside the master copy, when
    each of its values takes `value_bytes` (the master weights' dtype): what the planner
    counts."""
    return get(name).state_slots * value_bytes


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
