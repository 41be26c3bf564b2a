"""XLA flags a run sets before the backend starts: the GPU throughput preset and the collective
combine thresholds of `--bucket-mb`. The user's own XLA_FLAGS always win.

XLA reads XLA_FLAGS once, when the backend initializes, and aborts the process on a flag it does
not know. So `apply` runs before anything starts the backend (spmd.train calls it right after
parsing the flags), decides the platform without starting it (spmd.parallel.mesh.cpu_only),
and only uses flags that jaxlib 0.10.2 accepts (checked on its CPU and CUDA builds: the xla_gpu_*
debug options are parsed by both).

    GPU, --xla-preset throughput (the default): the latency-hiding scheduler, which moves
        collectives so they overlap compute (NVIDIA's JAX images set it), collectives on the
        highest-priority stream, and the pipelined all-gather / reduce-scatter / all-reduce that
        let a scanned layer's FSDP collectives overlap the previous layer (MaxText's list).
    GPU, --bucket-mb X > 0: XLA's all-reduce / reduce-scatter / all-gather combine thresholds
        = X MiB (the auto executor's bucket size; under explicit it keeps XLA from merging the
        hand-made buckets further).
    CPU, --bucket-mb X > 0 under --collectives explicit: XLA:CPU has no combine-threshold flag
        (jaxlib 0.10.2 rejects xla_cpu_*combine*); its cpu-all-reduce-combiner pass merges every
        independent all-reduce into one, which would undo the buckets, so that pass is disabled.
        Under auto on CPU --bucket-mb changes nothing (said at start).
    CPU, --xla-preset throughput: not an XLA flag but the allocator under it: glibc's malloc
        puts XLA's per-step buffers on transparent huge pages (spmd.parallel.huge_pages; a
        command restarts itself once to set it).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from typing import Any

from spmd.errors import UsageError
from spmd.parallel import huge_pages
from spmd.sections import ParallelConfig, choices

PRESETS = choices(ParallelConfig, "xla_preset")
GPU_THROUGHPUT = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
}
GPU_THRESHOLDS = (
    "xla_gpu_all_reduce_combine_threshold_bytes",
    "xla_gpu_reduce_scatter_combine_threshold_bytes",
    "xla_gpu_all_gather_combine_threshold_bytes",
)
CPU_NO_COMBINE = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def platform() -> str:
    """ "cpu", "gpu" or "tpu": where JAX will run, decided without starting its backend."""
    from spmd.parallel.mesh import cpu_only

    if cpu_only():
        return "cpu"
    return "tpu" if importlib.util.find_spec("libtpu") else "gpu"


def parse(text: str) -> dict[str, str]:
    """{flag name without dashes: value} of an XLA_FLAGS string ("true" for a bare flag)."""
    flags = {}
    for token in shlex.split(text):
        name, _, value = token.lstrip("-").partition("=")
        flags[name] = value if "=" in token else "true"
    return flags


def wanted(where: str, preset: str, bucket_mb: float, executor: str) -> dict[str, str]:
    """The flags spmd would set on platform `where` for a run's --xla-preset, --bucket-mb and
    --collectives (before the user's XLA_FLAGS are considered)."""
    if preset not in PRESETS:
        raise UsageError(f"--xla-preset {preset!r} is not a preset; use {' or '.join(PRESETS)}")
    if bucket_mb < 0:
        raise UsageError(f"--bucket-mb {bucket_mb:g} must be 0 (no buckets) or a size in MiB")
    flags: dict[str, str] = {}
    if where == "gpu":
        if preset == "throughput":
            flags.update(GPU_THROUGHPUT)
        if bucket_mb > 0:
            flags.update(dict.fromkeys(GPU_THRESHOLDS, str(int(bucket_mb * 2**20))))
    elif where == "cpu" and bucket_mb > 0 and executor == "explicit":
        flags.update(CPU_NO_COMBINE)
    return flags


def merge(user_text: str, flags: dict[str, str]) -> tuple[str, dict[str, str], dict[str, str]]:
    """(the new XLA_FLAGS, the flags added, those of `flags` the user's text already sets and
    that are therefore left as the user set them)."""
    user = parse(user_text)
    added = {k: v for k, v in flags.items() if k not in user}
    kept = {k: user[k] for k in flags if k in user}
    extra = " ".join(f"--{k}={v}" for k, v in added.items())
    return " ".join(part for part in (user_text.strip(), extra) if part), added, kept


def apply(
    preset: str, bucket_mb: float, executor: str, may_restart: bool | None = None
) -> dict[str, Any]:
    """Set XLA_FLAGS for this run (before the backend starts) and return what was done, for the
    config record: {"platform", "preset", "set": {flag: value}, "user_kept": {...},
    "xla_flags": the final XLA_FLAGS, "malloc": the huge-page tunable in effect or "", "note":
    a sentence or ""}. `may_restart`: whether this process may restart itself to get the CPU
    preset's malloc tunable (spmd.parallel.huge_pages); None: if it is one of spmd's commands."""
    import jax._src.xla_bridge as xla_bridge

    where = platform()
    flags = wanted(where, preset, bucket_mb, executor)
    text, added, kept = merge(os.environ.get("XLA_FLAGS", ""), flags)
    note = ""
    if where == "cpu" and bucket_mb > 0 and executor == "auto":
        note = (
            "XLA:CPU has no combine-threshold flags: --bucket-mb does not change auto's collectives"
        )
    started = xla_bridge.backends_are_initialized()
    if added and started:
        # In-process callers (tests, notebooks) that already started JAX: XLA would not read
        # the flags any more, so say so rather than leave them in the environment.
        note = "the JAX backend had already started: XLA flags not applied"
        added, text = {}, os.environ.get("XLA_FLAGS", "")
    elif added:
        os.environ["XLA_FLAGS"] = text
    restarts = (huge_pages.is_command() if may_restart is None else may_restart) and not started
    wants_tunable = huge_pages.wanted(where, preset)
    if restarts and not wants_tunable:
        huge_pages.undo_early_restart()  # returns unless the command's first line restarted it
    malloc = huge_pages.active()
    if wants_tunable and not malloc:
        if restarts:
            huge_pages.restart()  # returns only if the restart failed
        hint = f"set GLIBC_TUNABLES={huge_pages.TUNABLE}=1 before Python starts: XLA:CPU's "
        note = "; ".join(filter(None, (note, hint + "per-step buffers on huge pages")))
    return {
        "platform": where,
        "preset": preset,
        "set": added,
        "user_kept": kept,
        "xla_flags": text,
        "malloc": f"{huge_pages.TUNABLE}={malloc}" if malloc else "",
        "note": note,
    }


def describe(record: dict[str, Any]) -> str:
    """One line for the start of a run."""
    parts = [f"xla flags ({record['platform']}, preset {record['preset']}):"]
    parts.append(" ".join(f"--{k}={v}" for k, v in record["set"].items()) or "none set")
    if record["malloc"]:
        parts.append(f"| malloc: {record['malloc']}")
    if record["user_kept"]:
        kept = " ".join(f"--{k}={v}" for k, v in record["user_kept"].items())
        parts.append(f"| yours kept: {kept}")
    if record["note"]:
        parts.append(f"| {record['note']}")
    return " ".join(parts)
