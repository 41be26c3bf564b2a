"""A user-defined Flax NNX sequence classifier (not the Llama) trained with spmd's library API
on 1 device and on 4 simulated devices under dp=4 and fsdp=4 (ZeRO-3): same accuracy.

The task: is more than half of a sequence's tokens in the lower half of the vocabulary? The
model embeds the tokens, mean-pools them, adds a residual MLP block and classifies. It names
its params' logical axes (`embed`, `mlp`), so every layout can split them, and it reads params
through `spmd.gather` and marks its row-parallel matmul with `spmd.tp_reduce`, so the explicit
executor runs it too (both are no-ops under the default executor).

    python examples/sequence_classifier.py [--steps 60] [--executor auto|explicit]
"""

from __future__ import annotations

import argparse
import sys

VOCAB, LENGTH, CLASSES = 64, 15, 2


def make_classifier(seed: int):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import spmd

    class Classifier(nnx.Module):
        def __init__(self, embed: int, hidden: int, rngs: nnx.Rngs):
            def param(shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
                value = nnx.initializers.normal(0.1)(rngs.params(), shape, jnp.float32)
                return nnx.Param(value, out_sharding=names)

            self.embed = param((VOCAB, embed), (None, "embed"))
            self.w_in = param((embed, hidden), ("embed", "mlp"))  # column-parallel over tp
            self.w_out = param((hidden, embed), ("mlp", "embed"))  # row-parallel over tp
            self.head = param((embed, CLASSES), ("embed", None))

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = jnp.take(spmd.gather(self.embed), tokens, axis=0).mean(axis=1)  # [batch, embed]
            h = jax.nn.gelu(spmd.tp_enter(x, "mlp") @ spmd.gather(self.w_in))
            x = x + spmd.tp_reduce(h @ spmd.gather(self.w_out), "mlp")
            return x @ spmd.gather(self.head)  # [batch, classes] logits

    return Classifier(embed=32, hidden=64, rngs=nnx.Rngs(seed))


def classification_loss(model, batch):
    import optax

    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def make_data(n: int, seed: int):
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, VOCAB, (n, LENGTH), dtype=np.int32)
    labels = ((tokens < VOCAB // 2).sum(axis=1) > LENGTH // 2).astype(np.int32)
    return {"tokens": tokens, "labels": labels}


def train_and_score(mesh_spec: str, devices: list, steps: int, executor: str):
    """(final loss, test accuracy) after `steps` steps of batch 32 on `mesh_spec`."""
    import jax
    import numpy as np
    import optax

    import spmd

    mesh = spmd.make_mesh(mesh_spec, devices)
    program = spmd.build(
        make_classifier, classification_loss, optax.adam(1e-2), mesh, executor=executor
    )
    train, test = make_data(32 * steps, seed=0), make_data(512, seed=1)
    state = program.init()
    for step in range(steps):
        rows = slice(32 * step, 32 * (step + 1))
        batch = spmd.put_batch({k: v[rows] for k, v in train.items()}, program)
        state, metrics = program.step(state, batch)
    predict = jax.jit(lambda params, tokens: program.model(params)(tokens).argmax(-1))
    predicted = np.asarray(predict(state.params, test["tokens"]))
    return float(metrics["loss"]), float((predicted == test["labels"]).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--executor", default="auto", choices=["auto", "explicit"])
    args = parser.parse_args(argv)

    import spmd

    spmd.simulate_cpu_devices(4, announce=False)
    import jax

    results = {}
    for mesh_spec, count in (("dp=1", 1), ("dp=4", 4), ("fsdp=4", 4)):
        loss, accuracy = train_and_score(
            mesh_spec, jax.devices()[:count], args.steps, args.executor
        )
        results[mesh_spec] = accuracy
        print(
            f"{mesh_spec:<7} on {count} device(s): final loss {loss:.4f}, "
            f"test accuracy {accuracy:.3f}"
        )
    accuracies = set(results.values())
    if len(accuracies) != 1 or min(accuracies) < 0.9:
        print(f"FAILED: accuracies differ or are low: {results}")
        return 1
    print(f"same test accuracy on 1 and 4 devices under dp and fsdp: {accuracies.pop():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
