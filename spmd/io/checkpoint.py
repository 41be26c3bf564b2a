"""Fault-tolerant checkpoints (orbax): async saves, restore onto any mesh, fall back past damage.

A run's checkpoints live in `<checkpoint_dir>/<step>/`, one per saved step (the number of
optimizer steps done), each holding three items:

    state   the train state: a dict of named pytrees ({"params": ..., "opt_state": ...}; new
            entries such as a loss scale just join the dict), written shard by shard
    data    the data sampler's state (spmd.io.data.data_state: step, seed, batch, seq_len, ...)
    config  the resolved run config

RNG: every random choice of a run is a function of (seed, step) (params from the seed, the data
order from (seed, epoch)) and the train step draws no random numbers, so the seed and step in
`data` are the run's whole RNG state.

Saves are asynchronous: `save` returns once the arrays are copied to host memory and the files
are written by a background thread while training goes on. Orbax writes a step into
`<step>.orbax-checkpoint-tmp` and renames it when complete, so a crash, even `kill -9`, in the
middle of a save leaves the earlier checkpoints as they were and the partial folder is ignored.
Only the newest `keep` checkpoints (at least 2) are kept, and a new one is complete before an old
one goes. At least two, because the params of the newest checkpoint are only judged by the loss
of the step after it: when that step diverges, the newest checkpoint is moved aside to
`<step>.diverged` (spmd.training.divergence) and the one before it must still be there.

Restore reads into the ShapeDtypeStructs of the current program, which carry the current mesh's
shardings: orbax reshards while reading, so any layout restores any checkpoint of the same
model. Shapes are compared first (a checkpoint of another model is a UsageError naming the
param and both shapes); a step that cannot be read is moved aside to `<step>.damaged` (never
deleted) and the next older complete step is used instead.

Each step also holds `manifest.json` (spmd.io.manifest): every file's size and CRC-32, written
once orbax has committed the step. orbax itself keeps no checksums, so bytes flipped in a data
file would restore as garbage; a step is checked against its manifest before it is read, and
one that fails is damaged like an unreadable one. A step without a manifest is not trusted
silently: a resume takes the newest verified step and sets a newer unverified one aside to
`<step>.unverified`; only `--allow-unverified` reads it (a folder of an spmd older than
manifests). Whatever is restored is checked for finite values and its saved norms
(spmd.io.state_check) before training continues. Rotation deletes only steps that hold both
orbax's metadata and the manifest: a folder named like a step that spmd did not write is kept.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from spmd import paths
from spmd.errors import UsageError
from spmd.io import manifest
from spmd.io.save_failures import CLOSE_AFTER_FAILURE_S, SaveFailed, quiet_failed_saves

STATE, DATA, CONFIG = "state", "data", "config"
ORBAX_METADATA = "_CHECKPOINT_METADATA"  # the file orbax writes into every step it commits
PARTIAL_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step still being written
DAMAGED_SUFFIX = ".damaged"
DIVERGED_SUFFIX = ".diverged"  # a step whose params the next step's loss showed diverged
UNVERIFIED_SUFFIX = ".unverified"  # a step without a manifest, newer than a verified one
MIN_KEEP = 2  # see the module docstring
_ASIDE = itertools.count()  # set_aside's calls, the same on every process: unique barrier names


@dataclasses.dataclass
class Restored:
    """What a checkpoint gave back: the step it was saved after and its three items."""

    step: int
    state: dict[str, Any]
    data: dict[str, Any]
    config: dict[str, Any]


def complete_steps(directory: str) -> list[int]:
    """The steps of `directory` (a path or URL) whose checkpoints were completely written,
    ascending."""
    folder = paths.epath(directory)
    if not folder.is_dir():
        return []
    return sorted(ocp.utils.checkpoint_steps(folder))


def check_directory(directory: str, resume: str, allow_unverified: bool = False) -> bool:
    """Whether a run with `--resume resume` continues from the checkpoints of `directory`:
    "auto" when it holds a complete one, "required" always (UsageError when it holds none),
    "fresh" never (UsageError when it holds one: a fresh run would mix with or delete it).
    Under auto and required, UsageError too when every step was set aside as damaged (a fresh
    start would bury the run) or none has a manifest and `allow_unverified` is not given."""
    folder = paths.epath(directory)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--checkpoint-dir {directory} is a file; give a folder")
    steps = complete_steps(directory)
    damaged = set_aside_steps(directory, DAMAGED_SUFFIX) if resume != "fresh" else []
    if not steps and damaged:
        raise UsageError(
            f"--checkpoint-dir {directory} holds no readable checkpoint: every step was set "
            f"aside as damaged ({', '.join(damaged)}); restore one from a copy, or start this "
            f"run again at step 1 with --resume fresh"
        )
    if resume == "required" and not steps:
        partial = interrupted_saves(directory)
        found = f" (only {len(partial)} interrupted save(s))" if partial else ""
        raise UsageError(
            f"--resume required: --checkpoint-dir {directory} holds no complete checkpoint"
            f"{found}; run with --resume auto or fresh to start training"
        )
    if resume == "fresh" and steps:
        raise UsageError(
            f"--resume fresh: --checkpoint-dir {directory} already holds checkpoints (newest: "
            f"step {steps[-1]}); continue from it with --resume auto, or give an empty or new "
            f"folder"
        )
    verified = [s for s in steps if (folder / str(s) / manifest.MANIFEST).exists()]
    if steps and resume != "fresh" and not verified and not allow_unverified:
        raise UsageError(
            f"--checkpoint-dir {directory}: no step has a {manifest.MANIFEST} to verify it "
            f"(steps {', '.join(map(str, steps))}: an spmd older than manifests, or stopped "
            f"before writing one); resume from them unverified with --allow-unverified"
        )
    return bool(steps) and resume != "fresh"


def newest_verified(directory: str) -> int | None:
    """The newest step of `directory` a resume continues from: complete and with its manifest
    (None when there is none, or the folder is gone or unreadable)."""
    folder = paths.epath(directory)
    try:
        verified = [
            s for s in complete_steps(directory) if (folder / str(s) / manifest.MANIFEST).exists()
        ]
    except Exception:  # the folder itself is gone or unreadable
        return None
    return verified[-1] if verified else None


def set_aside_steps(directory: str, suffix: str) -> list[str]:
    """The names of the steps of `directory` set aside with `suffix` (<step><suffix>[n])."""
    folder = paths.epath(directory)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.glob(f"*{suffix}*") if p.name.split(".")[0].isdigit())


def interrupted_saves(directory: str) -> list[str]:
    """The names of the steps in `directory` whose saves never completed (a crash or kill in the
    middle of one); orbax replaces such a folder when it saves that step again."""
    folder = paths.epath(directory)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.glob(f"*{PARTIAL_SUFFIX}"))


def is_own_step(step_dir: Any) -> bool:
    """Whether a step folder is surely one orbax wrote for spmd: it holds orbax's metadata file
    and spmd's manifest. Only such steps are ever deleted (by rotation)."""
    return (
        step_dir.is_dir()
        and (step_dir / ORBAX_METADATA).exists()
        and (step_dir / manifest.MANIFEST).exists()
    )


class Manager(ocp.CheckpointManager):
    """orbax's CheckpointManager, which also writes each saved step's manifest once orbax has
    committed the step, in a thread of its own so that training goes on meanwhile.

    Committed: every process's shards written and `<step>.orbax-checkpoint-tmp` renamed to
    `<step>`, which orbax's finalize thread does and `wait_until_finished` joins. The manifest
    thread joins it too, then reads the whole folder, on process 0 only (orbax commits the step
    as a whole, so the folder is complete whoever wrote its shards). `wait_until_finished`,
    which orbax's `save` and `close` call first, waits for the manifest as well: no step is
    renamed, deleted, read or saved over while it is being read for its manifest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._manifest_thread: threading.Thread | None = None  # before orbax may wait on it
        self._in_flight: int | None = None  # the step whose save may still be running
        self._manifest_failed: tuple[int, OSError] | None = None  # a step left without one
        self.failed: SaveFailed | None = None
        super().__init__(*args, **kwargs)

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        try:  # orbax first waits for the previous save, whose failure surfaces here
            saved = super().save(step, *args, **kwargs)
        except SaveFailed:
            raise
        except Exception as e:  # orbax and tensorstore raise many types for a failed write
            raise self._failure(step, e) from None  # the previous save's fails in the wait
        self._in_flight = step if saved else self._in_flight
        if saved and jax.process_index() == 0:
            self._manifest_thread = threading.Thread(
                target=self._write_manifest, args=(step,), name=f"spmd_manifest_{step}"
            )
            self._manifest_thread.start()
        return saved

    def _get_old_steps_to_remove(self) -> list[int]:
        """orbax's choice of steps to delete, less any step that is not surely spmd's (a folder
        named like a step without orbax's metadata and a manifest: the user's, or unverified)."""
        return [
            s for s in super()._get_old_steps_to_remove() if is_own_step(self.directory / str(s))
        ]

    def wait_until_finished(self) -> None:
        try:
            super().wait_until_finished()
        except Exception as e:
            raise self._failure(self._in_flight, e) from None
        self._in_flight = None
        thread, self._manifest_thread = self._manifest_thread, None
        if thread is not None:
            thread.join()
        if self._manifest_failed is not None:  # the disk that took the step refused its manifest
            step, error = self._manifest_failed
            raise self._failure(step, error)

    def close(self) -> None:
        """orbax's close: waits for the save in flight. After a failed save its threads may
        never end (a write blocked on a read-only or full disk), so they get CLOSE_AFTER_FAILURE_S
        seconds in a thread of their own, and the process does not wait for them."""
        if self.failed is None:
            try:
                super().close()
                return
            except SaveFailed:
                raise
            except Exception as e:
                raise self._failure(self._in_flight, e) from None
        closing = threading.Thread(target=self._close_quietly, name="spmd_close", daemon=True)
        closing.start()
        closing.join(CLOSE_AFTER_FAILURE_S)

    def _close_quietly(self) -> None:
        try:
            super().close()
        except Exception:  # the failure was reported already
            pass

    def _failure(self, step: int | None, error: BaseException) -> SaveFailed:
        """The SaveFailed of `step`'s save (remembered: close stops waiting on it)."""
        self.failed = SaveFailed(str(self.directory), step, error_line(error), self._kept())
        return self.failed

    def _kept(self) -> int | None:
        return newest_verified(str(self.directory))

    def _write_manifest(self, step: int) -> None:
        try:
            super().wait_until_finished()
        except Exception:  # the save failed: orbax tells the training thread when it waits
            return
        try:
            manifest.write(self.directory / str(step))  # orbax keeps an epath.Path
        except OSError as e:  # a full disk, a quota: the step is not verified, so not saved
            self._manifest_failed = (step, e)


def open_manager(directory: str, keep: int) -> ocp.CheckpointManager:
    """An async CheckpointManager over `directory` (a local path, or a gs:// s3:// file:// URL:
    orbax takes an etils.epath.Path) that keeps the newest max(keep, MIN_KEEP) steps."""
    quiet_failed_saves()
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=True,
        preservation_policy=ocp.checkpoint_managers.LatestN(max(keep, MIN_KEEP)),
    )
    handlers = {
        STATE: ocp.StandardCheckpointHandler(),
        DATA: ocp.JsonCheckpointHandler(),
        CONFIG: ocp.JsonCheckpointHandler(),
    }
    return Manager(paths.epath(directory), options=options, item_handlers=handlers)


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: dict[str, Any],
    data_state: dict[str, Any],
    config: dict[str, Any],
) -> float:
    """Start saving checkpoint `step`; returns the seconds the caller was blocked (the copy to
    host, plus waiting for the previous save if it was still being written)."""
    started = time.perf_counter()
    manager.save(
        step,
        args=ocp.args.Composite(
            **{
                STATE: ocp.args.StandardSave(state),
                DATA: ocp.args.JsonSave(data_state),
                CONFIG: ocp.args.JsonSave(config),
            }
        ),
        force=True,
    )
    return time.perf_counter() - started


def error_line(error: BaseException) -> str:
    """One line for an orbax or tensorstore error: the first line of its innermost cause (the
    outer ones wrap it in the full TensorStore spec, a hundred lines), at most about 300
    characters: a longer one keeps its start and its end. The operating system's reason
    leads where tensorstore gives its code (`[os_error_code='28']`: No space left on device),
    since its own text for it may sit in the middle of the spec, where the cut falls."""
    while error.__cause__ is not None:
        error = error.__cause__
    line = (str(error).splitlines() or [""])[0]
    if len(line) > 300:
        line = f"{line[:120]} ... {line[-170:]}"
    code = re.search(r"os_error_code='(\d+)'", line)
    reason = f"{os.strerror(int(code.group(1)))}: " if code else ""
    return f"{type(error).__name__}: {reason}{line}"


def set_aside(manager: ocp.CheckpointManager, step: int, suffix: str) -> Any:
    """Rename complete step `step` to <step><suffix> (or <step><suffix>2, ...): kept for
    inspection, but no longer a step that a restore or --resume reads. Returns the new path."""
    source = manager.directory / str(step)  # an epath.Path
    target = source.with_name(f"{step}{suffix}")
    n = 1
    while target.exists():
        n += 1
        target = source.with_name(f"{step}{suffix}{n}")
    # Every process has named the target before process 0 renames, so all name the same one.
    call = next(_ASIDE)
    ocp.multihost.sync_global_processes(f"spmd_checkpoint_set_aside_named_{call}")
    if jax.process_index() == 0:
        source.rename(target)
    ocp.multihost.sync_global_processes(f"spmd_checkpoint_set_aside_done_{call}")
    manager.reload()
    return target
