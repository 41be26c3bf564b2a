"""What a run checks and takes before it writes anything: that the folders and the metrics file
it will write hold nothing spmd did not write, and a lock on each folder (spmd.training.
folder_lock), so that no user's file is overwritten and no two runs write one folder.

A run folder may hold what spmd puts there (spmd.training.run_folder): `config.toml` starting
with spmd's header, `metrics.jsonl`, `logs/` of `rank-NNNNN.log` files, `tensorboard/`,
`checkpoints/`, `profile/`, `wandb/`, `mlruns/`, `report.png` and the lock. A checkpoint folder
may hold step folders that orbax wrote (`<step>/` with orbax's `_CHECKPOINT_METADATA` or spmd's
manifest), interrupted saves (`<step>.orbax-checkpoint-tmp...`), the steps spmd set aside
(`<step>.damaged`, `.diverged`, `.unverified`, with a number after a second one) and the lock.
Anything else is the user's: the run exits 2 naming it, before any file is written. The metrics
file, when it exists and is not empty, must be an spmd metrics JSONL (a `config` record first)
of this run: its config names the same checkpoint folder.

In a job of several processes, process 0 checks and takes the locks and tells the others the
outcome through the distributed runtime's key-value store; all exit 2 together on a refusal.

A bucket folder (gs://, s3://) is checked for foreign files but not locked, and the run says
so in one line at its start. The lock needs an exclusive create (of two runs, exactly one
gets the file) and an unlink only by its holder; GCS and S3 each have one (a generation or
If-None-Match precondition), but the layer spmd writes buckets through (fsspec, under
orbax's epath) offers neither, and a lock made by looking first and writing after would let
two runs started together both take it: a lock that fails silently is worse than none.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from spmd import paths, sections
from spmd.errors import UsageError
from spmd.log import say, warn
from spmd.observe.metrics import TORN_SUFFIX
from spmd.sections import Config
from spmd.training import run_folder
from spmd.training.folder_lock import LOCK_FILE, FolderLocks

CLAIM_KEY = "spmd/folder_claim"
RUN_FOLDER_DIRS = {
    run_folder.LOGS, run_folder.TENSORBOARD, run_folder.CHECKPOINTS, run_folder.PROFILE,
    "wandb", "mlruns",
}  # fmt: skip
RUN_FOLDER_FILES = {
    run_folder.CONFIG_FILE, run_folder.METRICS_FILE, run_folder.METRICS_FILE + TORN_SUFFIX,
    run_folder.REPORT_FILE, run_folder.SAMPLES_FILE, run_folder.SAMPLES_REPORT,
}  # fmt: skip
RANK_LOG = re.compile(r"rank-\d{5}\.log")
SET_ASIDE = re.compile(r"\d+\.(damaged|diverged|unverified)\d*")
PARTIAL = re.compile(r"\d+\.orbax-checkpoint-tmp.*")
SHOWN = 5  # foreign names listed in the error
_HELD: list[FolderLocks] = []  # the locks of the run in progress, until `release`


def foreign_in_checkpoints(directory: Any) -> list[str]:
    """The names in a checkpoint folder (an epath or pathlib Path) that spmd did not write."""
    from spmd.io import manifest
    from spmd.io.checkpoint import ORBAX_METADATA

    if not directory.is_dir():
        return []
    foreign = []
    for entry in sorted(directory.iterdir(), key=lambda e: e.name):
        name = entry.name
        if name.startswith(LOCK_FILE):
            continue
        if entry.is_dir() and (SET_ASIDE.fullmatch(name) or PARTIAL.fullmatch(name)):
            continue
        if (
            entry.is_dir()
            and name.isdigit()
            and ((entry / ORBAX_METADATA).exists() or (entry / manifest.MANIFEST).exists())
        ):
            continue
        foreign.append(name + ("/" if entry.is_dir() else ""))
    return foreign


def foreign_in_run_folder(folder: Path, checkpoint_dir: str) -> list[str]:
    """The names in a local run folder that spmd did not write (its checkpoints/ judged as a
    checkpoint folder, its config.toml by spmd's header)."""
    if not folder.is_dir():
        return []
    foreign = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        name = entry.name
        shown = name + ("/" if entry.is_dir() else "")
        if name.startswith(LOCK_FILE) or name == run_folder.METRICS_FILE:  # metrics: below
            continue
        if name == run_folder.CONFIG_FILE and entry.is_file():
            if not entry.read_text(errors="replace").startswith(run_folder.CONFIG_HEADER):
                foreign.append(f"{name} (not one spmd wrote)")
        elif name == run_folder.LOGS and entry.is_dir():
            foreign += [
                f"{name}/{e.name}" for e in entry.iterdir() if not RANK_LOG.fullmatch(e.name)
            ]
        elif name == run_folder.CHECKPOINTS and entry.is_dir():
            if paths.epath(checkpoint_dir) != paths.epath(str(entry)):  # else checked as such
                foreign += [f"{name}/{n}" for n in foreign_in_checkpoints(paths.epath(str(entry)))]
        elif not (
            (name in RUN_FOLDER_DIRS and entry.is_dir())
            or (name in RUN_FOLDER_FILES and entry.is_file())
        ):
            foreign.append(shown)
    return foreign


def metrics_owner(path: str) -> str | None:
    """The checkpoint folder that an existing spmd metrics JSONL's run named ("" for none);
    None when `path` does not exist or is empty. UsageError when it is not an spmd metrics
    JSONL."""
    flat = metrics_config(path)
    return None if flat is None else str(flat.get("checkpoint_dir") or "")


def metrics_config(path: str) -> dict | None:
    """The flat config of an existing spmd metrics JSONL's first record; None when `path` does
    not exist or is empty. UsageError when it is not an spmd metrics JSONL."""
    if not paths.exists(path):
        return None
    try:
        with paths.open_file(path, "rb") as f:
            first = f.readline(1 << 24)
        if not first.strip():
            return None
        record = json.loads(first)
        if not isinstance(record, dict) or record.get("kind") != "config":
            raise ValueError("its first line is not an spmd config record")
        return sections.flat_values(record.get("config") or {})
    except (OSError, ValueError, AttributeError) as e:
        why = e if isinstance(e, ValueError) and "spmd" in str(e) else "not JSON lines"
        raise UsageError(
            f"--metrics {path} exists and is not an spmd metrics file ({why}); spmd would "
            f"overwrite it: give a new path"
        ) from None


def owner_here(path: str, owner: str, recorded_metrics: str) -> str:
    """The recorded checkpoint folder `owner` placed as it lies from the metrics file `path`
    now: the record wrote both paths as the run was given them (relative to the folder it
    started in), so a run folder resumed from another folder, or moved whole, keeps its
    checkpoints where its metrics say. `owner` as recorded where the two paths cannot be
    related (a bucket, one absolute and one relative, no metrics path recorded)."""
    if not recorded_metrics or any(paths.is_url(p) for p in (path, owner, recorded_metrics)):
        return owner
    if Path(owner).is_absolute() != Path(recorded_metrics).is_absolute():
        return owner
    apart = os.path.relpath(owner, os.path.dirname(recorded_metrics) or ".")
    return str(Path(paths.local(path)).parent / apart)


def check_metrics(cfg: Config) -> None:
    """UsageError when the metrics file exists and belongs to no run or another run."""
    path = cfg.observe.metrics
    if not path:
        return
    flat = metrics_config(path)
    owner = "" if flat is None else str(flat.get("checkpoint_dir") or "")
    mine = cfg.checkpoint.checkpoint_dir
    if flat is None or not owner or not mine:
        return
    if same_folder(owner_here(path, owner, str(flat.get("metrics") or "")), mine):
        return
    raise UsageError(
        f"--metrics {path} holds the metrics of another run (its checkpoints in {owner}, this "
        f"run's in {mine}); give a new --metrics, or the run's own --checkpoint-dir"
    )


def same_folder(a: str, b: str) -> bool:
    if paths.is_url(a) or paths.is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return Path(paths.local(a)).resolve() == Path(paths.local(b)).resolve()


def refuse_foreign(flag: str, folder: str, names: list[str]) -> None:
    if not names:
        return
    listed = ", ".join(names[:SHOWN]) + (
        f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    )
    raise UsageError(
        f"{flag} {folder} holds files spmd did not write ({listed}); spmd never writes over or "
        f"deletes them: give an empty or new folder, or move them out"
    )


def check_folder(cfg: Config, run_dir: str | None, folder: str) -> None:
    """UsageError naming what `folder` (the run folder or the checkpoint folder, once locked)
    holds that spmd did not write; with the checkpoint folder, the metrics file's too."""
    checkpoint_dir = cfg.checkpoint.checkpoint_dir
    if run_dir is not None and Path(folder) == Path(run_dir):
        refuse_foreign("--run-dir", folder, foreign_in_run_folder(Path(folder), checkpoint_dir))
    if checkpoint_dir and Path(folder) == Path(paths.local(checkpoint_dir)):
        names = foreign_in_checkpoints(paths.epath(checkpoint_dir))
        refuse_foreign("--checkpoint-dir", checkpoint_dir, names)


def check_unlocked(cfg: Config, run_dir: str | None) -> None:
    """The checks of what no lock covers: a bucket checkpoint folder, the metrics file."""
    checkpoint_dir = cfg.checkpoint.checkpoint_dir
    if checkpoint_dir and paths.is_url(checkpoint_dir):
        names = foreign_in_checkpoints(paths.epath(checkpoint_dir))
        refuse_foreign("--checkpoint-dir", checkpoint_dir, names)
    check_metrics(cfg)


def bucket_folders(cfg: Config, folder: str | None) -> list[str]:
    """The bucket folders the run writes (its run folder, its checkpoint folder): not locked."""
    found = [folder, cfg.checkpoint.checkpoint_dir]
    return [f for f in dict.fromkeys(found) if f and paths.is_url(f)]


def locked_folders(cfg: Config, folder: str | None) -> list[str]:
    """The local folders the run writes and locks: its run folder and checkpoint folder."""
    found = [folder, paths.local(cfg.checkpoint.checkpoint_dir)]
    return [f for f in found if f and not paths.is_url(f)]


def claim(cfg: Config, folder: str | None) -> FolderLocks:
    """Check the run's folders and take their locks (process 0; the others learn the outcome
    and raise the same UsageError). Returns the locks, to release when the run ends."""
    from spmd.parallel import distributed

    locks = FolderLocks([])  # none on the processes other than 0
    client, rank = distributed.client(), distributed.process_id()
    refusal = ""
    if rank == 0:
        locks = FolderLocks(locked_folders(cfg, folder))
        try:  # each locked first: another run's files half-written are never judged foreign
            locks.acquire(say, lambda locked: check_folder(cfg, folder, locked))
            check_unlocked(cfg, folder)
        except UsageError as e:
            locks.release()
            refusal = str(e)
        for bucket in [] if refusal else bucket_folders(cfg, folder):
            warn(
                f"{bucket} is not locked (a bucket has no exclusive create spmd can use): a "
                f"second run writing it at the same time would not be refused; start one at a time"
            )
    if client is not None:
        if rank == 0:
            client.key_value_set(CLAIM_KEY, refusal or "ok")
        else:
            told = client.blocking_key_value_get(CLAIM_KEY, run_folder.FOLDER_WAIT_MS)
            refusal = "" if told == "ok" else told
    if refusal:
        raise UsageError(refusal)
    _HELD.append(locks)
    return locks


def release() -> None:
    """Unlock the folders the run locked (every way out of a run calls this); a lock that
    cannot be removed is left with one warning line, never an error."""

    while _HELD:
        for left in _HELD.pop().release():
            warn(
                f"warning: could not remove the lock {left}; the next run in that folder takes "
                f"it over, since this process has ended"
            )


def holds_records(path: str) -> bool:
    """Whether the metrics file exists with records in it: a run starting at step 1 (its
    earlier start left no checkpoint, or `--resume fresh`) appends after them, never
    truncating what an earlier start of this run wrote."""
    return bool(path) and metrics_owner(path) is not None
