"""`spmd COMMAND [FLAGS]`: the installed command, one word per `python -m spmd.COMMAND`.

    spmd train --mesh dp=2,tp=4        is   python -m spmd.train --mesh dp=2,tp=4
    spmd plan --params 7e9 --gpu h100  is   python -m spmd.plan --params 7e9 --gpu h100

Each command parses its own flags (spmd.config.resolve); `spmd COMMAND --help` lists them.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, what it does), in the order a new user meets them
COMMANDS = {
    "train": ("spmd.train", "train a model on a mesh (the documented entry point)"),
    "plan": ("spmd.plan", "choose a layout for a model and cluster before renting it"),
    "bench": ("spmd.bench", "time the train step beside a bare jax.jit step"),
    "bench-collectives": ("spmd.bench_collectives", "compare executors, buckets, prefetch"),
    "data": ("spmd.data", "look at the training data: windows as text, counts per source"),
    "generate": ("spmd.generate", "sample text from a checkpoint or a Hugging Face folder"),
    "convert": ("spmd.convert", "Hugging Face folders <-> spmd checkpoints"),
    "checkpoint": ("spmd.checkpoint", "verify a checkpoint folder's steps against their manifests"),
    "report": ("spmd.report", "draw runs' metrics side by side"),
    "launch": ("spmd.launch", "start N local processes of one job"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items())
    return f"usage: spmd COMMAND [FLAGS]   (spmd COMMAND --help for its flags)\n\n{rows}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"error: {name!r} is not an spmd command; choose one of {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
