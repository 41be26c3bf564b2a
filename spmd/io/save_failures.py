"""A checkpoint save that fails (no permission, a full disk, a quota, the folder gone) ends the
run in one line: `SaveFailed`, raised by spmd.io.checkpoint.Manager, and the quieting of the
tracebacks orbax's and tensorstore's threads print meanwhile."""

from __future__ import annotations

import logging

from spmd.errors import UsageError
from spmd.io.stray_reads import quiet_stray_reads

CLOSE_AFTER_FAILURE_S = 20  # what a failed save's threads get to end before the process exits


class SaveFailed(UsageError):
    """A checkpoint could not be written (no permission, a full disk, a quota, the folder gone):
    one line naming the folder, the step lost and the newest step kept; exit status 2."""

    def __init__(self, directory: str, step: int | None, why: str, kept: int | None) -> None:
        self.directory, self.step, self.kept = directory, step, kept
        which = f"checkpoint step {step}" if step is not None else "a checkpoint"
        if kept is None:
            keeps = "it holds no complete step"
        else:
            keeps = f"it keeps step {kept}, which the same command continues from"
        super().__init__(f"{which} could not be saved in {directory} ({why}); {keeps}")


def quiet_failed_saves() -> None:
    """Keep a failed save's tracebacks off the terminal: orbax's threads log each error they
    meet (absl, with a traceback of a hundred lines each), and tensorstore's writes still
    running call back into orbax's closed event loop ("Event loop is closed", like a failed
    restore's reads: spmd.io.stray_reads). The Manager says in one line which step failed and
    which is kept (SaveFailed), so orbax's records that carry a traceback are dropped."""
    quiet_stray_reads()
    absl = logging.getLogger("absl")
    if not any(getattr(f, "spmd_quiet", False) for f in absl.filters):
        absl.addFilter(_OrbaxTracebacks())


class _OrbaxTracebacks(logging.Filter):
    spmd_quiet = True

    def filter(self, record: logging.LogRecord) -> bool:
        from_orbax = "orbax" in record.pathname.replace("\\", "/").split("/")
        return not (from_orbax and record.levelno >= logging.ERROR)
