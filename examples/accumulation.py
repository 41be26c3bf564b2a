"""Gradient accumulation: k micro-batches per optimizer step give the same update as one big
batch, and the gradients cross the wire once per step, not once per micro-batch.

The tiny Llama takes one AdamW step on the same global batch of 16 sequences, on 2 simulated
data-parallel devices, twice: `accum=1` (each device runs its 8 sequences at once) and
`accum=4` (4 micro-batches of 2 per device, summed in a scan inside the jitted step). The
loss is a per-token mean and every micro-batch holds the same number of tokens, so the mean
of the micro-batch means is the big batch's mean: the two updates agree to float rounding.
The optimizer is plain SGD, whose update is proportional to the gradient (Adam's first step,
lr * g / |g|, would flip sign on gradients that round to about zero). The script prints the
largest relative difference of the updates and the all-reduces over `data` in each compiled
step: accumulation moves the same gradient bytes as one big batch, in no more operations.

    python examples/accumulation.py [--accum 4] [--executor auto|explicit]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--executor", default="auto", choices=["auto", "explicit"])
    args = parser.parse_args(argv)

    import spmd

    spmd.simulate_cpu_devices(2, announce=False)
    import jax
    import numpy as np
    import optax

    from models import llama
    from spmd.estimate import hlo
    from spmd.run import config

    cfg = llama.LlamaConfig(**config.preset("tiny"))
    mesh = spmd.make_mesh("dp=2")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (16, 33), dtype=np.int32)
    host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    updates, reductions = {}, {}
    for accum in (1, args.accum):
        program = spmd.build(
            lambda seed: llama.create(cfg, seed),
            llama.lm_loss,
            optax.sgd(0.5),
            mesh,
            executor=args.executor,
            accum=accum,
        )
        compiled = program.compile_train_step(16, 32)
        state = program.init()
        before = jax.device_get(state.params)
        state, metrics = program.step(state, spmd.put_batch(host_batch, program))
        after = jax.device_get(state.params)
        updates[accum] = jax.tree.map(np.subtract, after, before)
        over_data = [c for c in hlo.collectives(compiled, mesh) if c.axes == ("data",)]
        count = sum(c.count for c in over_data)
        reductions[accum] = (count, sum(c.bytes * c.count for c in over_data))
        print(
            f"accum {accum}: loss {float(metrics['loss']):.6f}, all-reduces over data per step "
            f"{count} ({reductions[accum][1]:,} bytes per device)"
        )
    # Relative to the whole update's largest element: a leaf whose gradient nearly cancels
    # (a sum of terms 1e4 times its size) only shows the rounding of those terms.
    leaves_k, leaves_1 = jax.tree.leaves(updates[args.accum]), jax.tree.leaves(updates[1])
    scale = max(float(np.abs(b).max()) for b in leaves_1)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(leaves_k, leaves_1, strict=True))
    worst /= scale
    print(f"largest difference between the two updates, relative to the update: {worst:.2e}")
    (count_1, bytes_1), (count_k, bytes_k) = reductions[1], reductions[args.accum]
    if worst > 1e-5 or bytes_k != bytes_1 or count_k > count_1:
        print("FAILED: the updates differ, or accumulation added gradient reductions")
        return 1
    print(f"same update from {args.accum} micro-batches as from one big batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
