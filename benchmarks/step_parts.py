"""The parts of spmd's train step, each jitted alone: forward (the loss), forward + backward
(`jax.value_and_grad` of it) and the optimizer's update, for `against_torch.py --parts`, which
times them beside the same parts of the torch reference to say where the step's time differs.

Each part runs on the program's own params and shardings and a fixed batch; the update steps
a copy of the params, so that the other parts keep the initial ones, on constant gradients
(`update_gradient`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PARTS = ("forward", "forward+backward", "update")


def update_gradient(n_params: int, grad_clip: float) -> float:
    """The value of every gradient the update part gets: a global norm of half the clip's, so
    that clipping leaves them as they are (torch clips in place, and repeated scaling would
    reach denormals); benchmarks/torch_worker.py uses the same."""
    return 0.5 * (grad_clip or 1.0) / n_params**0.5


def spmd_parts(cfg: Any, program: Any) -> dict[str, Callable[[int], None]]:
    """{part: run it n times, then wait for the result}, for time_alternating."""
    import jax
    import jax.numpy as jnp
    import optax

    from models import family
    from spmd.run import builder

    loss_fn = family.of(cfg.model).loss
    params, opt_state, _ = program.init()
    tokens = jnp.zeros((cfg.run.batch, cfg.run.seq_len), jnp.int32)
    batch = jax.device_put({"inputs": tokens, "targets": tokens}, program.layout.batch_sharding())
    tx = builder.optimizer(cfg)(program.names)

    def loss(p: Any, b: dict) -> jax.Array:
        return loss_fn(program.model(p), b)

    def update(p: Any, o: Any, g: Any) -> tuple:
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o

    forward, backward = jax.jit(loss), jax.jit(jax.value_and_grad(loss))
    step = jax.jit(update, donate_argnums=(0, 1))
    n_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    value = update_gradient(n_params, cfg.optimizer.grad_clip)
    grads = jax.tree.map(lambda p: jnp.full_like(p, value), params)
    # the update steps its own copy: forward and backward keep reading `params`
    state = {"params": jax.tree.map(jnp.copy, params), "opt_state": opt_state}

    def run_forward(n: int) -> None:
        for _ in range(n):
            out = forward(params, batch)
        jax.block_until_ready(out)

    def run_backward(n: int) -> None:
        for _ in range(n):
            out = backward(params, batch)
        jax.block_until_ready(out)

    def run_update(n: int) -> None:
        p, o = state["params"], state["opt_state"]
        for _ in range(n):
            p, o = step(p, o, grads)
        jax.block_until_ready(p)
        state["params"], state["opt_state"] = p, o

    return dict(zip(PARTS, (run_forward, run_backward, run_update), strict=True))
