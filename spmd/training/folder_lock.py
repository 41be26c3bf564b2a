"""A lock on each folder a run writes (its run folder and checkpoint folder), so that two runs
never write one folder: the second exits 2 naming the first.

The lock is a file in the folder, `.spmd-lock`, holding JSON that names its holder:

    {"host": "node-7", "pid": 41230, "started": 1764201600.0, "heartbeat": 1764201630.0}

(`started` and `heartbeat` in Unix seconds). It is made whole or not at all: written under a
name of its own, then hard-linked to `.spmd-lock`, which fails when the name exists (a link,
unlike a rename, never replaces a file), so of two runs started together exactly one gets it.
A thread of the holder rewrites `heartbeat` every HEARTBEAT_S seconds while the run lives,
whatever the training loop is doing (compiling, a long save).

A lock whose holder is gone is taken over, with one line saying whose it was: its process is
not running on this host, or (on another host, or a frozen process) its heartbeat is older
than STALE_S. A run killed with SIGKILL, an OOM kill or a lost machine so leaves a lock that
the next run takes at once (same host) or after STALE_S (another host sharing the folder).
Two runs taking over one stale lock at once: each renames the stale file to a name of its own
before linking its lock, and only one rename of that file succeeds.

The lock is released (the file removed, when it is still this run's) on every way out of the
run, an exception included. A bucket folder (gs://, s3://) is not locked: object stores have
no exclusive create that this module uses; say one run per bucket folder yourself.

In a job of several processes, process 0 holds the locks for the job (spmd.training.claims).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from spmd.errors import UsageError

LOCK_FILE = ".spmd-lock"
HEARTBEAT_S = 30.0  # how often the holder rewrites its heartbeat
STALE_S = 600.0  # a heartbeat older than this: the holder is gone (another host, or frozen)


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock: host name, process id, start and last heartbeat (Unix seconds)."""

    host: str
    pid: int
    started: float
    heartbeat: float

    def describe(self, now: float) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"pid {self.pid} on {self.host} (started {started}, last heartbeat "
            f"{max(now - self.heartbeat, 0):.0f} s ago)"
        )

    def text(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"


def read_holder(path: Path) -> Holder | None:
    """The holder a lock file names; None when it is not a lock file of this module's."""
    try:
        fields = json.loads(path.read_text())
        return Holder(
            str(fields["host"]), int(fields["pid"]), float(fields["started"]),
            float(fields["heartbeat"]),
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stale_reason(holder: Holder, now: float) -> str | None:
    """Why `holder`'s lock no longer holds (its process is gone, or its heartbeat is older than
    STALE_S), or None while it does."""
    if holder.host == socket.gethostname() and not _alive(holder.pid):
        return "its process is no longer running"
    if now - holder.heartbeat > STALE_S:
        return f"no heartbeat for {now - holder.heartbeat:.0f} s (more than {STALE_S:.0f} s)"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class FolderLocks:
    """The locks of a run's local folders, from `acquire` to `release` (a context manager)."""

    def __init__(self, folders: list[str]) -> None:
        self.paths = [Path(folder) / LOCK_FILE for folder in dict.fromkeys(folders)]
        self.me = Holder(socket.gethostname(), os.getpid(), time.time(), time.time())
        self.held: list[Path] = []
        self._made: list[Path] = []  # folders acquire made, deepest first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(
        self,
        say: Callable[[str], None] = print,
        check: Callable[[str], None] = lambda folder: None,
    ) -> None:
        """Take every lock (making the folders), calling `check(folder)` once each is held; on
        any refusal release those taken (removing the folders this made, still empty) and raise
        UsageError, naming the holder of a lock that is held."""
        try:
            for path in self.paths:
                self._made += [p for p in (path.parent, *path.parent.parents) if not p.exists()]
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    self._take(path, say)
                except OSError as e:  # a file in the way, a read-only or full disk
                    raise UsageError(
                        f"{path.parent}: cannot write its lock {path.name} ({e.strerror or e}); "
                        f"give a folder this user can write"
                    ) from None
                self.held.append(path)
                check(str(path.parent))
        except BaseException:
            self.release()
            raise
        self._thread = threading.Thread(target=self._beat, name="spmd_folder_lock", daemon=True)
        self._thread.start()

    def release(self) -> list[str]:
        """Stop the heartbeat, remove the lock files that are still this run's and the folders
        `acquire` made that stayed empty (a run refused leaves no trace). Never raises: it runs
        on every way out of a run, where an error of its own would hide the run's (a save that
        failed) and keep Python waiting on the failed save's threads. Returns one text for each
        lock file left behind (a folder made read-only meanwhile: "PATH (why)"); the next run
        takes such a lock over, its process having ended."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        left = []
        for path in self.held:
            try:
                if self._mine(path):
                    path.unlink(missing_ok=True)
            except OSError as e:
                left.append(f"{path} ({e.strerror or e})")
        self.held = []
        for folder in self._made:  # deepest first
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote into it
                break
        self._made = []
        return left

    def __enter__(self) -> FolderLocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _take(self, path: Path, say: Callable[[str], None]) -> None:
        for _ in range(5):  # a race with another run taking over the same stale lock: retry
            if self._link(path):
                return
            holder, now = read_holder(path), time.time()
            if holder is None:  # unreadable: judged by its age alone
                try:
                    holder = Holder("an unknown host", -1, 0.0, path.stat().st_mtime)
                except FileNotFoundError:
                    continue  # released meanwhile
            why = stale_reason(holder, now)
            if why is None:
                raise UsageError(
                    f"{path.parent} is in use by another run: {holder.describe(now)} holds "
                    f"{path}; wait for it to end, or give another folder (a lock whose run is "
                    f"gone is taken over: its process ended, or no heartbeat for {STALE_S:.0f} s)"
                )
            if self._set_aside_stale(path, holder):
                say(f"took over the lock of {path.parent} from {holder.describe(now)}: {why}")
        raise UsageError(f"{path.parent}: could not take its lock {path}; several runs race for it")

    def _link(self, path: Path) -> bool:
        """Make `path` this run's lock unless it exists: whether it did."""
        partial = path.with_name(f"{LOCK_FILE}.{self.me.host}.{self.me.pid}.partial")
        partial.write_text(self.me.text())
        try:
            os.link(partial, path)
            return True
        except FileExistsError:
            return False
        finally:
            partial.unlink(missing_ok=True)

    def _set_aside_stale(self, path: Path, holder: Holder) -> bool:
        """Remove the stale lock of `holder`; False when another run took it over first."""
        aside = path.with_name(f"{LOCK_FILE}.{self.me.host}.{self.me.pid}.stale")
        try:
            path.rename(aside)
        except FileNotFoundError:
            return False
        if read_holder(aside) not in (holder, None):  # a live lock renamed by mistake: back
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def _mine(self, path: Path) -> bool:
        found = read_holder(path)
        return found is not None and (found.host, found.pid, found.started) == (
            self.me.host, self.me.pid, self.me.started,
        )  # fmt: skip

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            beat = dataclasses.replace(self.me, heartbeat=time.time())
            for path in self.held:
                if not self._mine(path):  # taken over after a stall: leave it to its holder
                    continue
                partial = path.with_name(f"{LOCK_FILE}.{self.me.host}.{self.me.pid}.beat")
                try:
                    partial.write_text(beat.text())
                    partial.replace(path)
                except OSError:  # a full disk must not end the run; the next beat tries again
                    continue
