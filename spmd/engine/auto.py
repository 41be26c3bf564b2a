"""The `auto` executor's train and eval steps: plain JAX under the layout's activation
constraints, inside the jit that spmd.engine.step builds; XLA's SPMD partitioner inserts the
collectives (spmd.engine.explicit is the hand-written counterpart)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from spmd.engine import frozen, optim, precision
from spmd.engine.accumulate import accumulated_grads
from spmd.engine.options import StepOptions
from spmd.parallel import traced_layout
from spmd.parallel.layout import Layout


def auto_steps(
    loss_of: Callable,
    tx: optax.GradientTransformation,
    layout: Layout,
    shardings: dict[str, Any],
    options: StepOptions,
) -> tuple[Callable, Callable]:
    """(train_step, eval_step) of the `auto` executor, not yet jitted, for `layout` (a
    spmd.parallel.layout.Layout). `loss_of(params, batch)` is the loss of the global batch; with
    options.accum > 1 the step loops over micro-batches. Mesh axes in options.exclude_axes are
    left out of the activation rules (an enclosing vmap owns them). The signature is
    spmd.engine.explicit.explicit_steps's."""
    mesh, zero, sp = layout.mesh, layout.zero_stage, layout.sequence_parallel
    accum, policy, exclude = options.accum, options.policy, options.exclude_axes

    def train_step(params: Any, opt_state: Any, loss_scale: Any, batch: dict[str, jax.Array]):
        # frozen params (spmd.engine.frozen) are constants here: no gradients, no update
        params, fixed = frozen.split(params)
        grad_fn = precision.scaled_value_and_grad(frozen.bind(loss_of, fixed), loss_scale, policy)
        # Differentiating w.r.t. params in the reduce dtype makes the gradients (their sums over
        # micro-batches and devices) that dtype: 16-bit halves the bytes, fp32 keeps precision.
        grad_params = precision.cast(params, policy.reduce_dtype)
        with (
            traced_layout.activation_layout(mesh, zero, exclude=exclude, sequence_parallel=sp),
            traced_layout.context_attention(layout.cp_mode),
            traced_layout.training(optim.update_count(opt_state)),
        ):
            if accum == 1:
                loss, grads = grad_fn(grad_params, batch)
            else:
                loss, grads = accumulated_grads(
                    grad_fn,
                    grad_params,
                    batch,
                    accum,
                    mesh,
                    zero,
                    shardings["grads"],
                    policy.reduce_dtype,
                    exclude,
                    options.row_group,
                )
        grads = jax.lax.with_sharding_constraint(grads, shardings["grads"])
        params, opt_state, loss_scale, grads = precision.apply_gradients(
            tx, grads, params, opt_state, loss_scale, policy
        )
        metrics = {
            "loss": loss.astype(policy.output_dtype),
            "grad_norm": optax.tree.norm(grads),
            "loss_scale": loss_scale["scale"],
            "skipped_steps": loss_scale["skipped_steps"],
        }
        return frozen.join(params, fixed), opt_state, loss_scale, metrics

    def eval_step(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        with (
            traced_layout.activation_layout(mesh, zero, sequence_parallel=sp),
            traced_layout.context_attention(layout.cp_mode),
        ):
            return loss_of(params, batch)

    return train_step, eval_step
