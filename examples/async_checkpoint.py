"""Does an async checkpoint stall training? Step time with and without a save in flight.

    PYTHONPATH=. python examples/async_checkpoint.py [--model small] [--mesh fsdp=8] [--saves 5]

Trains the model with the real program and spmd.io.checkpoint.save, timing every step to
completion (dispatch + block_until_ready). Each round times a few steps with no save, then
starts a save and times the steps that run while orbax writes it in the background, until it is
complete; rounds interleave so that both kinds of step see the same machine load. Prints
medians side by side: the step time without and with a save in flight, the time `save` blocks
the loop (copy to host), and how long a save takes to complete. Nothing is asserted; numbers
depend on the machine (on a CPU the writer threads share the cores with the step).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="model preset (configs/NAME.toml)")
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--quiet-steps", type=int, default=3, help="steps per round, no save")
    parser.add_argument("--saves", type=int, default=8, help="rounds (one save each)")
    args = parser.parse_args()

    from spmd.parallel import mesh as mesh_lib

    sizes = mesh_lib.parse_mesh(args.mesh)
    if mesh_lib.cpu_only() and (mesh_lib.devices_needed(sizes) or 1) > 1:
        mesh_lib.simulate_cpu_devices(mesh_lib.devices_needed(sizes), announce=False)

    import jax
    import numpy as np

    from models import family
    from spmd.io import checkpoint, data
    from spmd.run import builder, config

    preset = config.preset(args.model)
    model_cfg = config.build(family.check_fields(preset, args.model), preset, args.model)
    cfg = config.flat(
        model_cfg, model=args.model, batch=args.batch, seq_len=args.seq_len, steps=1000
    )
    program = builder.program(cfg, mesh_lib.build_mesh(sizes))  # the step spmd.train runs
    layout = program.layout
    compiled = program.compile_train_step(args.batch, args.seq_len)
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, 1 << 20)
    windows = data.TokenWindows(tokens, args.seq_len, 0.0)
    sharding = layout.batch_sharding()
    params, opt_state, loss_scale = program.init()
    state = {"params": params, "opt_state": opt_state, "loss_scale": loss_scale}
    step = 0

    def timed_step() -> float:
        nonlocal state, step
        ids = data.train_window_ids(0, step, args.batch, windows.n_train)
        started = time.perf_counter()
        batch = data.global_batch(windows, ids, sharding)
        new_params, new_opt, new_scale, metrics = compiled(
            state["params"], state["opt_state"], state["loss_scale"], batch
        )
        jax.block_until_ready(metrics)
        state = {"params": new_params, "opt_state": new_opt, "loss_scale": new_scale}
        step += 1
        return time.perf_counter() - started

    for _ in range(3):
        timed_step()  # warm-up
    quiet, in_flight, blocked, complete = [], [], [], []
    with tempfile.TemporaryDirectory() as directory:
        manager = checkpoint.open_manager(directory, keep=2)
        for _ in range(args.saves):
            quiet.extend(timed_step() for _ in range(args.quiet_steps))
            started = time.perf_counter()
            blocked.append(checkpoint.save(manager, step, state, {"step": step}, {}))
            while manager.is_saving_in_progress():
                in_flight.append(timed_step())
            complete.append(time.perf_counter() - started)
            timed_step()  # a step after the save, not counted
        manager.close()

    state_mib = checkpoint_bytes(state) / 2**20
    print(
        f"{args.model} ({family.of(model_cfg).n_params(model_cfg) / 1e6:.1f} M params, state "
        f"{state_mib:.0f} MiB) on {args.mesh} x {jax.devices()[0].device_kind}, "
        f"batch {args.batch} x {args.seq_len}"
    )
    print(f"step time, no save in flight:  median {ms(quiet)} over {len(quiet)} steps")
    print(f"step time, save in flight:     median {ms(in_flight)} over {len(in_flight)} steps")
    print(f"save() blocking the loop:      median {ms(blocked)} over {len(blocked)} saves")
    print(f"save start to complete:        median {ms(complete)}")


def checkpoint_bytes(state: dict) -> int:
    import jax

    return sum(leaf.nbytes for leaf in jax.tree.leaves(state))


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ms" if values else "n/a (none)"


if __name__ == "__main__":
    main()
