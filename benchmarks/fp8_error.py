"""fp8's quantization error on the tiny preset at fixed params and batches, without training
noise: the loss's bias and the gradient's relative error against fp32, per recipe and
gradient format, and the share of each fp8 operand's elements that its scale puts below the
format's normal range (subnormal or zero). docs/strategies/fp8.md quotes it beside the loss
table, whose seed-to-seed noise is larger than these differences.

    python benchmarks/fp8_error.py [--steps 200] [--bf16 k,v]

The params are the tiny preset's after `--steps` bf16 Adam steps (lr 3e-3) on the test corpus
(tests/trainer.py), so that the gradients are a trained model's; the error is the mean over 4
batches of 16 x 64 tokens. `--bf16 k,v` keeps those block matmuls (q k v o gate up down, by
call order) in bf16, to see which ones the error comes from.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import fp8, llama
from spmd.io import data
from spmd.parallel import fp8_context
from spmd.parallel.fp8_context import Fp8Settings
from tests import trainer

MATMULS = ("q", "k", "v", "o", "gate", "up", "down")  # a Llama block's, in call order
BATCHES = 4


def batch(step: int) -> dict:
    win = trainer.windows(64)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return data.global_batch(win, data.train_window_ids(0, step, 16, win.n_train), device)


def trained(steps: int) -> tuple[Any, Any]:
    """(graph, fp32 params) of the tiny model after `steps` bf16 Adam steps."""
    graph, params = nnx.split(llama.create(trainer.tiny_config(), 0, jnp.float32))
    opt = optax.adam(3e-3)

    @jax.jit
    def step(params: Any, state: Any, b: dict) -> tuple[Any, Any]:
        grads = jax.grad(loss)(params, graph, b, jnp.bfloat16)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = opt.init(params)
    for i in range(steps):
        params, state = step(params, state, batch(i))
    return graph, params


def loss(params: Any, graph: Any, b: dict, dtype: Any) -> jax.Array:
    cast = jax.tree.map(lambda x: x.astype(dtype), params)
    return llama.lm_loss(nnx.merge(graph, cast), b)


@contextlib.contextmanager
def kept_in_bf16(names: set[str]) -> Iterator[None]:
    """fp8_context.site answering None for the block matmuls named (by call order)."""
    count, in_block, site = [0], fp8_context.in_block, fp8_context.site

    def counted(*args: Any) -> Any:
        count[0] = 0
        return in_block(*args)

    def filtered(k: int, n: int) -> Any:
        found = site(k, n)
        if found is not None:
            count[0] += 1
            if MATMULS[(count[0] - 1) % len(MATMULS)] in names:
                return None
        return found

    fp8_context.in_block, fp8_context.site = counted, filtered  # type: ignore[assignment]
    try:
        yield
    finally:
        fp8_context.in_block, fp8_context.site = in_block, site  # type: ignore[assignment]


@contextlib.contextmanager
def counting_below_normal(found: dict[str, list[float]]) -> Iterator[None]:
    """fp8.quantize also recording, per fp8 dtype, the share of nonzero elements it puts below
    the dtype's smallest normal."""
    quantize = fp8.quantize

    def counted(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
        scaled = jnp.abs(x.astype(jnp.float32) / scale)
        nonzero = scaled > 0
        below = jnp.sum(nonzero & (scaled < float(jnp.finfo(dtype).smallest_normal)))
        share = below / jnp.maximum(jnp.sum(nonzero), 1)
        name = jnp.dtype(dtype).name
        jax.debug.callback(lambda s: found.setdefault(name, []).append(float(s)), share)
        return quantize(x, scale, dtype)

    fp8.quantize = counted  # type: ignore[assignment]
    try:
        yield
    finally:
        fp8.quantize = quantize  # type: ignore[assignment]


def flat(tree: Any) -> jax.Array:
    return jnp.concatenate([x.ravel().astype(jnp.float32) for x in jax.tree.leaves(tree)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--bf16", default="", help="block matmuls kept in bf16, e.g. k,v")
    args = parser.parse_args()
    graph, params = trained(args.steps)
    batches = [batch(1000 + i) for i in range(BATCHES)]
    exact = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 3))
    reference = [exact(params, graph, b, jnp.float32) for b in batches]

    def report(name: str, results: list) -> None:
        bias = np.mean([float(r[0] - e[0]) for r, e in zip(results, reference, strict=True)])
        error = np.mean(
            [
                float(jnp.linalg.norm(flat(r[1]) - flat(e[1])) / jnp.linalg.norm(flat(e[1])))
                for r, e in zip(results, reference, strict=True)
            ]
        )
        print(f"{name:22s} loss bias {bias:+.5f}  gradient error {100 * error:5.2f}%", end="")

    report("bf16", [exact(params, graph, b, jnp.bfloat16) for b in batches])
    print()
    keep = {n for n in args.bf16.split(",") if n}
    for recipe in ("tensorwise", "rowwise"):
        for grad in ("e5m2", "e4m3"):
            chosen = fp8_context.GRAD_FORMAT[recipe]
            fp8_context.GRAD_FORMAT[recipe] = grad
            below: dict[str, list[float]] = {}
            settings = Fp8Settings(recipe=recipe, min_dim=0)

            def traced(params: Any, b: dict, settings: Any = settings, below: dict = below) -> Any:
                with fp8_context.use(settings), kept_in_bf16(keep), counting_below_normal(below):
                    return jax.value_and_grad(loss)(params, graph, b, jnp.bfloat16)

            try:
                step = jax.jit(traced)
                report(f"{recipe} {grad}", [step(params, b) for b in batches])
            finally:
                fp8_context.GRAD_FORMAT[recipe] = chosen
            jax.effects_barrier()
            shares = "  ".join(f"{k}: max {100 * max(v):.2f}%" for k, v in sorted(below.items()))
            print(f"  below normal: {shares}")


if __name__ == "__main__":
    main()
