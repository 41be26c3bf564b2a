"""Your own training loop on spmd's library API: mesh, sharded state, steps, eval, checkpoint.

Trains the tiny Llama on byte tokens of a Python standard-library module with a loop written
out by hand, saves a checkpoint, restores it onto a different mesh, and checks that the
restored model gives the same eval loss. Change `--mesh` and nothing else to go from one
device to many (or to many hosts, under spmd.launch).

    python examples/custom_loop.py [--mesh dp=2,fsdp=2] [--restore-mesh tp=4] [--steps 30]
"""

from __future__ import annotations

import argparse
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="dp=2,fsdp=2")
    parser.add_argument("--restore-mesh", default="tp=4")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)

    import spmd

    spmd.simulate_cpu_devices(4, announce=False)
    import inspect
    import json

    import numpy as np
    import optax

    from models import llama
    from spmd.run import config

    text = np.frombuffer(inspect.getsource(json.decoder).encode(), np.uint8).astype(np.int32)
    rng = np.random.default_rng(0)

    def host_batch(n: int) -> dict[str, np.ndarray]:  # random windows of seq_len + 1 bytes
        starts = rng.integers(0, len(text) - args.seq_len - 1, n)
        rows = np.stack([text[s : s + args.seq_len + 1] for s in starts])
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}

    cfg = llama.LlamaConfig(**config.preset("tiny"))

    def build(mesh_spec: str) -> spmd.Program:
        return spmd.build(
            lambda seed: llama.create(cfg, seed),
            llama.lm_loss,
            optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-3, 5, args.steps)),
            spmd.make_mesh(mesh_spec),
        )

    program = build(args.mesh)
    state = program.init()
    for step in range(1, args.steps + 1):
        state, metrics = program.step(state, spmd.put_batch(host_batch(args.batch), program))
        if step % 10 == 0:
            print(f"step {step}: loss {float(metrics['loss']):.4f} on mesh {args.mesh}")
    held_out = host_batch(args.batch)
    eval_loss = float(program.eval_step(state.params, spmd.put_batch(held_out, program)))

    with tempfile.TemporaryDirectory() as directory:
        manager = spmd.checkpoints(directory)
        spmd.save(manager, args.steps, state, {"note": "custom loop"})
        manager.wait_until_finished()
        other = build(args.restore_mesh)
        step, restored, metadata = spmd.restore(manager, other)
        other_loss = float(other.eval_step(restored.params, spmd.put_batch(held_out, other)))
    print(f"eval loss {eval_loss:.6f} on {args.mesh}; restored step {step} ({metadata['note']}) "
          f"on {args.restore_mesh}: {other_loss:.6f}")  # fmt: skip
    if abs(other_loss - eval_loss) > 1e-4 * abs(eval_loss):
        print("FAILED: the restored model's eval loss differs")
        return 1
    print("the checkpoint restored onto another mesh gives the same eval loss")
    return 0


if __name__ == "__main__":
    sys.exit(main())
