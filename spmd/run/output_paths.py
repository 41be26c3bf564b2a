"""Output places a run writes, checked before it writes there: of the right kind (a file, a
folder) and writable by this process."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from spmd import paths
from spmd.errors import UsageError
from spmd.run.config import Config


def check_paths(cfg: Config) -> None:
    """UsageError for an output path the run could not write, found before it writes there
    (after compiling): a folder given as the --metrics file, a file (or a path under a file)
    where a folder is made, a device other than a terminal, pipe or /dev/null as the metrics
    file, or a place this process cannot write (no permission, a read-only file system, /proc)."""
    from spmd.io import tokens

    run_dir = cfg.run.run_dir if cfg.run.run_dir != "none" else ""
    folders = {
        "--run-dir": run_dir,
        "--checkpoint-dir": cfg.checkpoint.checkpoint_dir,
        "--tensorboard": cfg.observe.tensorboard,
        "--profile-dir": cfg.observe.profile_dir,
        "--data-cache": cfg.data.data_cache or str(tokens.default_cache_dir()),
    }
    for flag, path in [("--metrics", cfg.observe.metrics), *folders.items()]:
        path = paths.local(path)
        if not path or paths.is_url(path):  # a bucket is checked when it is written
            continue
        check_place(flag, path, folder=flag != "--metrics")


def check_folder(flag: str, path: str) -> None:
    """UsageError unless output folder `path` (a local path) of `flag` is a folder or can be
    made, and this process can write it (check_place)."""
    check_place(flag, path, folder=True)


def check_place(flag: str, path: str, folder: bool) -> None:
    """UsageError for local output `path` of `flag` (a folder when `folder`, else a file) that
    is of the other kind, lies under a file, or that this process cannot write."""
    given = Path(path)
    if given.exists() and given.is_dir() != folder:
        kind, wanted = ("a file", "a folder") if folder else ("a folder", "a file path")
        raise UsageError(f"{flag} {path} is {kind}; give {wanted}")
    above = next(a for a in given.absolute().parents if a.exists())
    if not given.exists() and not above.is_dir():
        raise UsageError(f"{flag} {path}: {above} is a file, so nothing can be made under it")
    check_writable(flag, given if given.exists() else above, path)


def check_writable(flag: str, where: Path, given: str) -> None:
    """UsageError unless this process can write `where`: make (and drop) a file in a folder,
    open an existing file for appending; a device file only when it is a terminal, a pipe or
    /dev/null (/dev/full takes nothing)."""

    try:
        if where.is_dir():
            try:
                with tempfile.TemporaryFile(dir=where):
                    pass
            except OSError as e:
                raise UsageError(
                    f"{flag} {given}: cannot make files in {where} ({e.strerror})"
                ) from None
            return
        mode = where.stat().st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            with where.open("ab") as f:
                if not (f.isatty() or os.path.samefile(where, os.devnull)):
                    raise UsageError(f"{flag} {given} is a device, not a file; give a file path")
            return
        if not stat.S_ISFIFO(mode):
            where.open("ab").close()
    except OSError as e:
        raise UsageError(f"{flag} {given}: cannot write {where} ({e.strerror})") from None
