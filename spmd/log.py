"""What a run tells the person watching: progress on stdout, trouble on stderr, from process 0.

The bottom of spmd's package order: every package may print through here, and this module
imports nothing of spmd.
"""

from __future__ import annotations

import sys

# Only one process of a multi-process job talks to the person and writes the metrics file.
_PRIMARY = {"is_primary": True}


def set_primary(is_primary: bool) -> None:
    """Say whether this process prints progress and writes metrics (process 0 does)."""
    _PRIMARY["is_primary"] = is_primary


def is_primary() -> bool:
    """Whether this process prints progress and writes metrics."""
    return _PRIMARY["is_primary"]


def say(message: str) -> None:
    """A progress message for the person watching (stdout, flushed; process 0 only)."""
    if _PRIMARY["is_primary"]:
        print(message, file=sys.stdout, flush=True)


def warn(message: str) -> None:
    """A line for the person that ends or endangers the run (stderr, flushed; process 0 only)."""
    if _PRIMARY["is_primary"]:
        print(message, file=sys.stderr, flush=True)
