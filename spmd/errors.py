"""The one exception type for user mistakes.

Anything the user can fix (a bad flag value, a mesh that does not fit the devices, a model
dimension an axis does not divide) raises `UsageError` with one sentence naming the bad value
and what would be valid. The command-line entry points turn it into exit status 2 with no
traceback; library callers get an ordinary `ValueError` subclass. `end_process` is how a
command's process ends, whatever threads a failure left running.
"""

import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn


class UsageError(ValueError):
    """A user input that cannot work; the message names the value and what would be valid."""


def run_command(run: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """Run a command's `run(argv)`; a UsageError becomes one line on stderr and status 2."""
    try:
        return run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def end_process(main: Callable[[], int]) -> NoReturn:
    """Run a command's `main` as the process and exit with its status. After a failure (a
    status other than 0, or an exception: its traceback, status 1) a thread that Python's exit
    would wait for may still run: orbax writing a save to a disk that refuses it, which may
    never end, or the save a second SIGINT gave up. The process then leaves at once, its output
    flushed: that step is lost and was reported, and orbax renames a step's folder only once it
    is complete, so the steps kept stay whole."""
    try:
        status = main()
    except BaseException:
        if not threads_left():
            raise
        traceback.print_exc()
        status = 1
    if status and threads_left():
        leave(status)
    sys.exit(status)


def leave(code: int) -> NoReturn:
    """End the process now with `code`, its output flushed, waiting for no thread."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def threads_left() -> bool:
    """Whether a thread that Python's exit would wait for still runs (an orbax writer)."""
    main_thread = threading.main_thread()
    return any(
        t.is_alive() and not t.daemon and t is not main_thread for t in threading.enumerate()
    )
