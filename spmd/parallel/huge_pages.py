"""Transparent huge pages for XLA:CPU's per-step buffers (`--xla-preset throughput` on a CPU).

XLA:CPU allocates a step's temp buffer afresh at every execution (325 MB for the benchmark
model of docs/speed.md), and glibc's malloc serves a block that large with a new mmap: the
kernel then faults in and zeroes every 4 KiB page of it, at every step (79k page faults and
about 150 ms of kernel time per step there). glibc's tunable `glibc.malloc.hugetlb=1` makes
malloc ask for transparent huge pages on those blocks (madvise), so a step faults 2 MiB pages
instead: the benchmark step ran 1.19x faster. glibc reads tunables only when a process starts, so a
command restarts itself once with the tunable in its environment (`os.execve`: same process
id, same arguments), before JAX starts its backend. Only spmd's own commands restart; an
interpreter that imported spmd (a notebook, pytest) is told how to set it.

A command restarts at its first line (`restart_early`), before it imports JAX and Flax, judging
from its command line alone: restarting where the preset is known, after the imports, cost
1.5-2.5 s of every start (a tiny one-step run: 10.8-12.2 s against 8.2-9.0 s). Where the
resolved preset then does not want the tunable (`xla_preset = "none"` in a config file),
`undo_early_restart` restarts once more with GLIBC_TUNABLES as it was.

It is wanted only where it changes something: a CPU run under the throughput preset, on Linux
with glibc 2.35 or later (the first with the tunable), where the kernel's transparent huge
pages are in `madvise` mode (`always` gives them without asking, `never` refuses them).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
# Set by `restart_early` to GLIBC_TUNABLES as the command was started with: the restart is done
# (never again in this process), and `undo_early_restart` knows what to go back to.
EARLY = "SPMD_TUNABLES_BEFORE_RESTART"


def runs_on_cpu(platforms: str) -> bool:
    """Whether JAX will run on the host CPU, decided with the standard library alone (before
    JAX is imported): `platforms` (JAX_PLATFORMS's value) names cpu first or, when it is empty,
    no accelerator plugin is installed."""
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(name) for name in ACCELERATOR_PLUGINS)


def thp_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise, never), "" if unknown."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def glibc_has_tunable() -> bool:
    """Whether this interpreter runs on glibc 2.35 or later."""
    name, version = platform.libc_ver()
    parts = version.split(".")
    return name == "glibc" and len(parts) >= 2 and (int(parts[0]), int(parts[1])) >= (2, 35)


def wanted(where: str, preset: str) -> bool:
    """Whether a run on platform `where` under `preset` would use the tunable."""
    if where != "cpu" or preset != "throughput":
        return False
    return thp_mode() == "madvise" and glibc_has_tunable()


def active() -> str:
    """The tunable's value in the environment this process started with, the one glibc read
    ("" if not set): a variable set later (os.environ) changes nothing in this process."""
    try:
        start = Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    given = next((v.partition("=")[2] for v in start if v.startswith("GLIBC_TUNABLES=")), "")
    for item in given.split(":"):
        name, _, value = item.partition("=")
        if name == TUNABLE:
            return value
    return ""


def is_command() -> bool:
    """Whether this process is one of spmd's commands (`python -m spmd.train`, ...), which
    may restart itself, rather than an interpreter that imported spmd."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name.split(".")[0] == "spmd"


def with_tunable(given: str) -> str:
    """A GLIBC_TUNABLES value: `given` with the tunable set to 1 in front, or `given` as it is
    if it names the tunable already (yours wins)."""
    if TUNABLE in given:
        return given
    # first: glibc 2.36 leaves only the first tunable in the environment it shows the process
    # (/proc/self/environ), which is where `active` looks
    return ":".join(filter(None, (f"{TUNABLE}=1", given)))


def restart(early: bool = False) -> None:
    """Run this process again from its start, with the tunable added to GLIBC_TUNABLES;
    returns at once if GLIBC_TUNABLES names it already (yours wins, and a restart could not
    change it), and returns if the restart failed. `early`: `restart_early`'s, recorded in the
    new process's environment (EARLY)."""
    given = os.environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in given:
        return
    env = {**os.environ, "GLIBC_TUNABLES": with_tunable(given)}
    if early:
        env[EARLY] = given
    _execve(env)


def restart_early(argv: list[str]) -> None:
    """At the first line of a command run with `argv`: restart it with the tunable where its
    run will want it (a CPU, the kernel and glibc taking it, no `--xla-preset none` on the
    command line), before it imports JAX. Once per command: never after a restart of its own."""
    pairs = zip(argv, argv[1:], strict=False)
    if EARLY in os.environ or "--xla-preset=none" in argv or ("--xla-preset", "none") in pairs:
        return
    where = "cpu" if runs_on_cpu(os.environ.get("JAX_PLATFORMS", "")) else "accelerator"
    if wanted(where, "throughput") and not active():
        restart(early=True)


def undo_early_restart() -> None:
    """Restart with GLIBC_TUNABLES as the command was started with, if `restart_early` added
    the tunable (for a run whose resolved preset does not want it); returns otherwise."""
    given = os.environ.pop(EARLY, None)
    if given is None or TUNABLE in given or not active():
        return
    env = {**os.environ, EARLY: given, "GLIBC_TUNABLES": given}
    if not given:
        del env["GLIBC_TUNABLES"]
    _execve(env)


def _execve(env: dict[str, str]) -> None:
    """This process again from its start (same process id and arguments) in `env`; returns if
    that failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return
