"""Mixed-precision policies and dynamic loss scaling.

A policy names four dtypes: `param` (the master weights the optimizer updates, and so the
optimizer state), `compute` (what the model casts params and activations to for its matmuls),
`reduce` (gradient accumulators and the cross-device gradient reduction) and `output` (the loss
reported). Master weights stay fp32 in every policy: updates of lr * 1e-3 relative size vanish
in a 16-bit mantissa.

fp16 has 5 exponent bits, so small gradients underflow to zero in its backward pass. The loss
is multiplied by a scale before differentiation and the gradients divided by it after; the
scale is dynamic: it halves (and that optimizer step is skipped) when a gradient is not finite,
and doubles after `growth_interval` finite steps in a row. bf16 has fp32's exponent range and
needs no scaling.

The scale lives in a small pytree of replicated scalars, part of the train state (so it can be
checkpointed): {"scale": f32, "good_steps": i32, "skipped_steps": i32}.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from spmd.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

LossScale = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes of one precision policy and, for fp16, the loss-scale dynamics."""

    name: str
    param_dtype: Any
    compute_dtype: Any
    reduce_dtype: Any
    output_dtype: Any
    loss_scaling: bool = False
    initial_scale: float = 2.0**15
    growth_interval: int = 2000  # finite steps in a row before the scale grows
    growth_factor: float = 2.0
    backoff_factor: float = 0.5  # on a non-finite gradient


F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
POLICIES = {
    "fp32": Policy("fp32", F32, F32, F32, F32),
    "bf16": Policy("bf16", F32, BF16, F32, F32),
    "fp16": Policy("fp16", F32, F16, F32, F32, loss_scaling=True),
}


def get(name: str) -> Policy:
    """The policy called `name`; UsageError naming the valid ones otherwise."""
    if name not in POLICIES:
        raise UsageError(f"--precision {name!r} is not one of {', '.join(POLICIES)}")
    return POLICIES[name]


def describe(policy: Policy) -> str:
    """One line for the run log, e.g. "bf16: params fp32, compute bf16, grad reduce fp32"."""

    def short(dtype: Any) -> str:
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[jnp.dtype(dtype).name]

    scaling = (
        f", dynamic loss scale from {policy.initial_scale:g} (x{policy.growth_factor:g} after "
        f"{policy.growth_interval} finite steps, x{policy.backoff_factor:g} and skip on overflow)"
        if policy.loss_scaling
        else ""
    )
    return (
        f"precision {policy.name}: params {short(policy.param_dtype)}, compute "
        f"{short(policy.compute_dtype)}, grad reduce {short(policy.reduce_dtype)}, output "
        f"{short(policy.output_dtype)}{scaling}"
    )


def init_loss_scale(policy: Policy) -> LossScale:
    """The loss-scale state at step 0 (scale 1 when the policy does not scale)."""
    return {
        "scale": jnp.asarray(policy.initial_scale if policy.loss_scaling else 1.0, jnp.float32),
        "good_steps": jnp.zeros((), jnp.int32),
        "skipped_steps": jnp.zeros((), jnp.int32),
    }


def all_finite(tree: Any) -> jax.Array:
    """True (a bool scalar) when every element of every leaf is finite."""
    return jnp.stack([jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)]).all()


def unscale(grads: Any, state: LossScale, policy: Policy) -> Any:
    """Gradients of the scaled loss divided by the scale (unchanged when not scaling)."""
    if not policy.loss_scaling:
        return grads
    inverse = 1.0 / state["scale"]
    return jax.tree.map(lambda g: g * inverse.astype(g.dtype), grads)


def next_loss_scale(state: LossScale, finite: jax.Array, policy: Policy) -> LossScale:
    """The state after a step whose gradients were `finite` or not: back off and count a skip
    on overflow; grow after `growth_interval` finite steps in a row."""
    if not policy.loss_scaling:
        return state
    good = jnp.where(finite, state["good_steps"] + 1, 0)
    grow = good >= policy.growth_interval
    scale = jnp.where(
        finite,
        jnp.where(grow, state["scale"] * policy.growth_factor, state["scale"]),
        jnp.maximum(state["scale"] * policy.backoff_factor, jnp.finfo(jnp.float32).tiny),
    )
    return {
        "scale": scale,
        "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
        "skipped_steps": state["skipped_steps"] + (~finite).astype(jnp.int32),
    }


def keep_if_finite(finite: jax.Array, updated: Any, current: Any) -> Any:
    """`updated` when `finite`, else `current`, leaf by leaf: a skipped step changes nothing."""
    return jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, current)


def scaled_value_and_grad(
    loss_of: Callable[[Any, Any], jax.Array], state: LossScale, policy: Policy
) -> Callable[[Any, Any], tuple[jax.Array, Any]]:
    """`(params, batch) -> (loss, grads of loss * scale)`: jax.value_and_grad of `loss_of`, the
    loss multiplied by the current scale first when the policy scales (the loss returned is
    unscaled)."""
    if not policy.loss_scaling:
        return jax.value_and_grad(loss_of)

    def scaled(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
        loss = loss_of(params, batch)
        return loss * state["scale"], loss

    def loss_and_grads(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params, batch)
        return loss, grads

    return loss_and_grads


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: Any,
    params: Any,
    opt_state: Any,
    state: LossScale,
    policy: Policy,
) -> tuple[Any, Any, LossScale, Any]:
    """One optimizer update from (reduced) gradients of the scaled loss: unscale, update, and
    when the policy scales, skip the update (params and optimizer state returned as they were)
    if any gradient is not finite. Returns (params, opt_state, loss-scale state, unscaled
    grads). The gradients must be the global ones, so every device takes the same decision."""
    grads = unscale(grads, state, policy)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if policy.loss_scaling:
        finite = all_finite(grads)
        new_params, new_opt_state = keep_if_finite(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        state = next_loss_scale(state, finite, policy)
    return new_params, new_opt_state, state, grads
