"""The `spmd` command's subcommands: one table, read by spmd.cli (which runs them) and
spmd.completion (which completes their flags)."""

from __future__ import annotations

# command -> (module, what it does), in the order a new user meets them
COMMANDS = {
    "train": ("spmd.train", "train a model on a mesh (the documented entry point)"),
    "plan": ("spmd.plan", "choose a layout for a model and cluster before renting it"),
    "bench": ("spmd.bench", "time the train step beside a bare jax.jit step"),
    "bench-collectives": ("spmd.bench_collectives", "compare executors, buckets, prefetch"),
    "data": ("spmd.data", "look at the training data: windows as text, counts per source"),
    "generate": ("spmd.generate", "sample text from a checkpoint or a Hugging Face folder"),
    "eval": ("spmd.eval", "lm-evaluation-harness tasks on a checkpoint, on any mesh"),
    "convert": ("spmd.convert", "Hugging Face folders <-> spmd checkpoints"),
    "checkpoint": ("spmd.checkpoint", "verify a checkpoint folder's steps against their manifests"),
    "report": ("spmd.report", "draw runs' metrics side by side"),
    "launch": ("spmd.launch", "start N local processes of one job"),
    "completion": ("spmd.completion", "print a tab-completion script for bash, zsh or tcsh"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items())
    return f"usage: spmd COMMAND [FLAGS]   (spmd COMMAND --help for its flags)\n\n{rows}"
