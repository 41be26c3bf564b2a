"""The memory arithmetic of data parallelism: what one device holds under DDP and ZeRO-1/2/3,
from the textbook formula and from the compiled step, side by side.

Mixed into one table for a model of P params trained with fp32 Adam on N devices:

    per device     params        gradients     Adam m and v
    DDP            4P            4P            8P
    ZeRO-1         4P            4P            8P / N
    ZeRO-2         4P            4P / N        8P / N
    ZeRO-3         4P / N        4P / N        8P / N

The compiled column is read from the shardings the compiled train step takes its params and
optimizer state in (spmd.engine.state_layout.state_bytes_per_device); the gradients live only inside
the step, in XLA's temp buffers, so that column shows the compiled temp size instead. The script
checks that params + Adam state agree with the formula to within Adam's 4-byte step counter.

    python examples/memory_fit.py [--model small] [--devices 8]
"""

from __future__ import annotations

import argparse
import sys

LAYOUTS = {"DDP": ("dp", 3), "ZeRO-1": ("fsdp", 1), "ZeRO-2": ("fsdp", 2), "ZeRO-3": ("fsdp", 3)}


def formula(n_params: int, devices: int, layout: str) -> dict[str, float]:
    """Bytes per device of fp32 params, gradients and Adam's two moments under `layout`."""
    stage = 0 if layout == "DDP" else int(layout[-1])
    split = {"params": stage >= 3, "grads": stage >= 2, "adam": stage >= 1}
    full = {"params": 4 * n_params, "grads": 4 * n_params, "adam": 8 * n_params}
    return {k: full[k] / (devices if split[k] else 1) for k in full}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="preset in configs/")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(argv)

    import spmd

    spmd.simulate_cpu_devices(args.devices, announce=False)
    import optax

    from models import llama
    from spmd.engine.state_layout import state_bytes_per_device
    from spmd.estimate import hlo
    from spmd.run import config

    cfg = llama.LlamaConfig(**config.preset(args.model))
    n_params, mib = cfg.n_params(), 2**20
    print(f"{args.model}: P = {n_params:,} params, fp32 Adam, N = {args.devices} devices (MiB)")
    print(
        f"{'layout':<8}{'params':>9}{'grads':>9}{'Adam':>9}{'formula':>10}"
        f"{'compiled':>10}{'temp':>9}"
    )
    worst = 0
    for name, (axis, zero) in LAYOUTS.items():
        mesh = spmd.make_mesh(f"{axis}={args.devices}")
        program = spmd.build(
            lambda seed: llama.create(cfg, seed), llama.lm_loss, optax.adam(1e-3), mesh,
            zero_stage=zero,
        )  # fmt: skip
        compiled = program.compile_train_step(args.devices * 2, 64)
        want = formula(n_params, args.devices, name)
        held = state_bytes_per_device(compiled, program)
        state_formula, state_compiled = want["params"] + want["adam"], sum(held.values())
        worst = max(worst, abs(state_compiled - state_formula))
        print(
            f"{name:<8}{want['params'] / mib:>9.2f}{want['grads'] / mib:>9.2f}"
            f"{want['adam'] / mib:>9.2f}{state_formula / mib:>10.2f}{state_compiled / mib:>10.2f}"
            f"{hlo.memory(compiled)['temp'] / mib:>9.2f}"
        )
    print("formula = params + Adam state; compiled = what the step's input shardings hold")
    if worst > 4:
        print(f"FAILED: params + Adam state differ from the formula by {worst:.0f} bytes")
        return 1
    print(f"params + Adam state per device match the formula (largest gap {worst:.0f} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
