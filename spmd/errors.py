"""The one exception type for user mistakes, and the way every command ends.

Anything the user can fix (a bad flag value, a mesh that does not fit the devices, a model
dimension an axis does not divide) raises `UsageError` with one sentence naming the bad value
and what would be valid. The command-line entry points turn it into exit status 2 with no
traceback; library callers get an ordinary `ValueError` subclass. `end_process` is how a
command's process ends, whatever threads a failure left running.

The entry points also own stdout's failures: a reader that closed the pipe (`spmd data
preview | head`) ends the command quietly with status 141, as a command killed by SIGPIPE
(git, cat) reports it to the shell; a device that takes nothing more (`> /dev/full`) is one
line and status 2.
"""

import errno
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

CLOSED_PIPE_STATUS = 141  # 128 + SIGPIPE (13): what a shell shows for a SIGPIPE death


class UsageError(ValueError):
    """A user input that cannot work; the message names the value and what would be valid."""


class _WatchedOutput:
    """sys.stdout as a command writes it, keeping the OSErrors its writes and flushes met, so
    that the command's end tells stdout's failures from any other OSError."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.failures: list[OSError] = []

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self.failures.append(e)
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self.failures.append(e)
            raise

    def met(self, error: OSError) -> bool:
        """Whether `error` is one that writing stdout raised."""
        return any(error is failure for failure in self.failures)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self.stream, name)


def run_command(run: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """Run a command's `run(argv)`: a UsageError becomes one line on stderr and status 2, a
    closed stdout status 141 with nothing printed, another failure to write stdout one line
    and status 2. A command that puts its own stream in sys.stdout (spmd.train's, which
    outlives a lost console) keeps its own way with it."""
    if sys.stdout is None or isinstance(sys.stdout, _WatchedOutput):
        # no stdout at all (`>&-`: print writes nothing), or a command run by another, whose
        # run_command ends it
        return _run_reporting(run, argv)
    watched = _WatchedOutput(sys.stdout)
    sys.stdout = watched  # type: ignore[assignment]
    code, escaped, exiting = 2, False, None
    try:
        code = _run_reporting(run, argv)
    except OSError as e:
        if not watched.met(e):
            raise
        escaped = True
    except SystemExit as e:  # argparse's --help and its one-line errors: their text flushed first
        exiting = e
    finally:
        owned = sys.stdout is watched  # (else the command put its own stream there)
        if owned:
            sys.stdout = watched.stream
            _flush(watched)
    if watched.failures and (owned or escaped):
        return _output_lost(watched.failures[0], watched.stream)
    if exiting is not None:
        raise exiting
    return code


def _flush(watched: _WatchedOutput) -> None:
    """Write what the command left in stdout's buffer now (a failure is kept by `watched`)."""
    try:
        watched.flush()
    except OSError:
        pass


def _run_reporting(run: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
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


def _output_lost(failure: OSError, stream: Any) -> int:
    """The status for stdout's failure: 141 and silence for a closed pipe, else one line."""
    if failure.errno == errno.EPIPE:
        return CLOSED_PIPE_STATUS
    print(
        f"error: {_named(stream)} takes no more output ({failure.strerror}); send the output to "
        f"a file or a pipe that can take it",
        file=sys.stderr,
    )
    return 2


def _named(stream: Any) -> str:
    """'stdout (/dev/full)': what stdout is, where the system says."""
    try:
        return f"stdout ({os.readlink(f'/proc/self/fd/{stream.fileno()}')})"
    except (OSError, ValueError, AttributeError):  # no /proc, no file descriptor
        return "stdout"
