"""Keep a failed checkpoint restore's stray reads off the terminal.

orbax runs a restore's reads in an event loop that it closes as soon as one read fails;
tensorstore finishes the other reads afterwards. Their errors surface where no code can catch
them: as "Event loop is closed" in callbacks, as the read's own error in orbax's read
coroutine, and as asyncio's "exception was never retrieved" log of a read task or of the
gathering of several, each with a long traceback (one per array still being read). The restore
has already said in one line which step could not be read, so these are noise.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

# orbax's coroutine that reads one array shard (orbax/checkpoint/_src/serialization)
STRAY_READ = "_read_array_index_and_device_put"


def quiet_stray_reads() -> None:
    """Keep a failed restore's stray reads off the terminal. orbax runs a restore's reads in an
    event loop that it closes as soon as one read fails; tensorstore finishes the other reads
    afterwards, and their callbacks into the closed loop raise where no code can catch them, so
    Python prints a traceback for each (one per array still being read). From the first
    restore on, this process drops exactly those errors ("Event loop is closed", raised with no
    object, and a read's own error raised in orbax's read coroutine or logged by asyncio as
    never retrieved, after the restore stopped waiting for it); anything else is printed as
    before. Restores call this first."""
    previous = sys.unraisablehook
    if getattr(previous, "spmd_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        error, where = unraisable.exc_value, unraisable.object
        closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        # a read's own failure, raised in its coroutine after the restore gave up on it (the
        # restore has already said in one line which step could not be read)
        stray_read = getattr(getattr(where, "cr_code", None), "co_name", "") == STRAY_READ
        if not ((closed_loop and where is None) or stray_read):
            previous(unraisable)

    hook.spmd_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    # the same reads, when asyncio finds their task's (or their gathering's) error unretrieved
    logging.getLogger("asyncio").addFilter(lambda record: not _from_stray_read(record))


def _from_stray_read(record: logging.LogRecord) -> bool:
    """Whether an asyncio log record is about an error raised in orbax's read coroutine."""
    if STRAY_READ in record.getMessage():
        return True
    error = record.exc_info[1] if record.exc_info else None
    trace = error.__traceback__ if error is not None else None
    while trace is not None:
        if trace.tb_frame.f_code.co_name == STRAY_READ:
            return True
        trace = trace.tb_next
    return False
