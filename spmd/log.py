"""What a run tells the person watching and what it keeps: Python `logging` under the logger
"spmd", at the level of `--log-level`.

- the console: process 0 only, the bare message, progress (info, debug) on stdout and trouble
  (warning, error) on stderr, each line flushed;
- a file per process (`rank_file`): every process, every line at the level, with the time,
  rank and level, e.g. `<run folder>/logs/rank-00003.log`.

The console handler looks up sys.stdout / sys.stderr when it writes, not when it is made, so
output redirected later (a test's capture, a notebook) still receives it. The bottom of spmd's
package order: every package may log through here, and this module imports nothing of spmd.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

LOGGER = logging.getLogger("spmd")
LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

FILE_FORMAT = "%(asctime)s rank {rank} %(levelname)s %(message)s"

# Only one process of a multi-process job talks to the person and writes the metrics file.
_PRIMARY = {"is_primary": True}


class _Console(logging.Handler):
    """The bare message on this process's stdout (below warning) or stderr, process 0 only."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _PRIMARY["is_primary"]:
            return
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            print(self.format(record), file=stream, flush=True)
        except (OSError, ValueError):
            # The reader is gone (`| head` done, `> /dev/full`): the line is dropped, not
            # reported as logging's traceback; the command's end says what stdout met
            # (spmd.errors.run_command) and a rank file, where open, keeps the line.
            pass
        except Exception:  # a line that cannot be formatted: logging's own report, no end
            self.handleError(record)


_CONSOLE = _Console()
LOGGER.addHandler(_CONSOLE)
LOGGER.setLevel(logging.INFO)
LOGGER.propagate = False  # the root logger's handlers (absl's, a notebook's) would repeat lines
_FILE: dict[str, logging.Handler | None] = {"handler": None}


class _Tolerant:
    """A console stream whose loss does not end the process: once a write or flush fails (the
    reader gone: a launcher killed, `| head` done; EPIPE, EIO), it writes nothing more. The
    rank files keep every line."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.lost = stream, False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # ValueError: written after the stream was closed
                self.lost = True
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self.lost = True

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def survive_a_lost_console() -> None:
    """Keep this process going when whatever reads its stdout and stderr goes away (its
    launcher SIGKILLed, a pipe closed): SIGPIPE ignored (then a write fails with EPIPE) and
    Python's streams made to drop what they cannot write, so that a stop signal still ends
    the run with its agreed step saved."""
    import signal

    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Tolerant):
            setattr(sys, name, _Tolerant(stream))


def set_primary(is_primary: bool) -> None:
    """Say whether this process prints progress and writes metrics (process 0 does)."""
    _PRIMARY["is_primary"] = is_primary


def is_primary() -> bool:
    """Whether this process prints progress and writes metrics."""
    return _PRIMARY["is_primary"]


def set_level(level: str) -> None:
    """Log at `level` (debug, info, warning, error) from now on, console and file alike."""
    LOGGER.setLevel(LEVELS[level])


def open_rank_file(path: str | Path, rank: int) -> Path:
    """Also write every line of this process to `path` (created with its folder; appended to,
    so a resumed run keeps the earlier lines); replaces an earlier rank file. Returns the path."""
    close_rank_file()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT.format(rank=rank)))
    LOGGER.addHandler(handler)
    _FILE["handler"] = handler
    return path


def close_rank_file() -> None:
    """Stop writing the rank file (a run's end; the next run of this process opens its own)."""
    handler, _FILE["handler"] = _FILE["handler"], None
    if handler is not None:
        LOGGER.removeHandler(handler)
        handler.close()


def to_rank_file(message: str, level: int = logging.ERROR) -> None:
    """Write a line to this process's rank file only, when one is open (what the console
    already showed another way: a user error's one line, which the command prints itself)."""
    handler = _FILE["handler"]
    if handler is not None:
        handler.handle(LOGGER.makeRecord(LOGGER.name, level, __file__, 0, message, (), None))


def debug(message: str) -> None:
    """Detail for whoever debugs a run (shown with --log-level debug)."""
    LOGGER.debug(message)


def say(message: str) -> None:
    """A progress message for the person watching (info: stdout of process 0, every rank file)."""
    LOGGER.info(message)


def warn(message: str) -> None:
    """A line for the person that ends or endangers the run (warning: stderr of process 0)."""
    LOGGER.warning(message)
