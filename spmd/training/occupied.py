"""Whether a folder that a command other than training would write (spmd.convert's outputs)
belongs to a run, so that it writes nowhere a run lives.

A run's folder and checkpoint folder hold only what spmd.train writes there (spmd.training.
claims): a resume refuses them once they hold anything else, and a live run writes new steps
and files into them at any moment. So the output of a conversion may be neither such a folder
nor inside one. A folder belongs to a run when it or a folder above it

- holds a run's lock (spmd.training.folder_lock), live (the run is writing it: in use) or
  left by a run that ended (its folder all the same);
- is a run folder: its config.toml begins with the header spmd writes;
- is a checkpoint folder: it holds a step folder that orbax or spmd's manifest marks.

A URL (a bucket) is not looked at: buckets hold no lock (spmd.training.claims).
"""

from __future__ import annotations

import time
from pathlib import Path

from spmd import paths
from spmd.errors import UsageError
from spmd.training import run_folder
from spmd.training.folder_lock import LOCK_FILE, FolderLocks, read_holder, stale_reason


def run_of(folder: Path) -> str | None:
    """Why `folder` itself is a run's (in use by a live run or command, a run folder, a
    checkpoint folder), or None."""
    from spmd.io import manifest
    from spmd.io.checkpoint import ORBAX_METADATA

    lock = folder / LOCK_FILE
    holder = read_holder(lock) if lock.is_file() else None
    if holder is not None and stale_reason(holder, time.time()) is None:
        return f"in use ({holder.describe(time.time())} holds its lock {lock})"
    if lock.exists():
        return f"a run's folder (it holds {LOCK_FILE}, a run's lock)"
    config = folder / run_folder.CONFIG_FILE
    if config.is_file() and config.read_text(errors="replace").startswith(run_folder.CONFIG_HEADER):
        return f"a run folder (its {run_folder.CONFIG_FILE} is a run's)"
    if not folder.is_dir():
        return None
    for step in folder.iterdir():
        marks = (step / ORBAX_METADATA, step / manifest.MANIFEST)
        if step.name.isdigit() and step.is_dir() and any(m.exists() for m in marks):
            return f"a checkpoint folder (it holds step {step.name})"
    return None


def check_free(flag: str, target: str) -> None:
    """UsageError when output folder `target` of `flag` is, or is inside, a run's folder (the
    module docstring), naming that folder and why."""
    if paths.is_url(target):
        return
    given = Path(paths.local(target)).absolute()
    for folder in (given, *given.parents):
        why = run_of(folder) if folder.exists() else None
        if why is None:
            continue
        where = f"is {folder}" if folder == given else f"is inside {folder}"
        raise UsageError(
            f"{flag} {target} {where}, {why}; spmd writes nothing into a run's folders (a "
            f"resume refuses files it did not write): give a folder outside it"
        )


def hold(folder: str) -> FolderLocks:
    """The lock of output folder `folder` (made), taken for as long as a command writes it, so
    that a run or another command starting meanwhile is refused; release it (a context
    manager) when done, which removes the lock file."""
    locks = FolderLocks([paths.local(folder)])
    locks.acquire(say=lambda line: None)
    return locks
