"""Run metrics: the JSONL record stream of docs/contracts.md and the console progress line.

Records are dicts with a `kind`: one "config" first, one "train" per logged step, "eval"
records, one "summary" at the end. Values are plain JSON numbers and strings; times are
seconds, throughput tokens per second.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from spmd import paths
from spmd.errors import UsageError
from spmd.log import is_primary, warn
from spmd.observe.trackers import one_line


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float (a skipped fp16 step's grad norm) as None, so each
    line is strict JSON (null) that jq and other parsers accept."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


class MetricsLog:
    """Append-only JSONL writer (no file when `path` is empty; a local path or a URL,
    spmd.paths), flushed after every record so a crashed run still leaves its history.
    `append` continues an existing file (a resumed run) instead of starting it afresh. Every
    record also goes to each of `trackers` (spmd.observe.trackers); a tracker that raises is
    dropped with one warning line, and the run and the other trackers go on."""

    def __init__(self, path: str = "", append: bool = False, trackers: Sequence[Any] = ()) -> None:
        self._file: IO[str] | None = None
        self.path = path
        if path and is_primary():
            try:
                if append:
                    set_aside_torn_line(path)
                self._file = paths.open_file(path, "a" if append else "w")
            except OSError as e:
                raise UsageError(f"--metrics {path}: cannot write it ({e.strerror or e})") from None
        self._trackers = list(trackers)  # open_trackers opens them on process 0 only

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            record = strict_json({"kind": kind, **fields})
            try:
                self._file.write(json.dumps(record, allow_nan=False) + "\n")
                self._file.flush()
            except OSError as e:  # a full disk, a quota: the run ends with one line (exit 2)
                self._drop_file()
                raise UsageError(
                    f"--metrics {self.path}: cannot write a {kind} record ({e.strerror or e})"
                ) from None
        for tracker in list(self._trackers):
            self._guarded(tracker, "write", kind, fields)

    def track(self, kind: str, **fields: Any) -> None:
        """Give a record to the trackers alone, not the JSONL (the samples of
        --sample-every, which have their own file)."""
        for tracker in list(self._trackers):
            self._guarded(tracker, "write", kind, fields)

    def _guarded(self, tracker: Any, method: str, *args: Any) -> None:
        """Call a tracker's `method`; one that fails is dropped with one line (never fatal)."""
        try:
            getattr(tracker, method)(*args)
        except Exception as e:
            if tracker in self._trackers:
                self._trackers.remove(tracker)
            warn(f"warning: tracker {tracker.name} failed ({one_line(e)}); going on without it")

    def _drop_file(self) -> None:
        """Close the file after a failed write, its unwritten buffer given up."""
        file, self._file = self._file, None
        if file is None:
            return
        try:
            file.close()
        except OSError:  # the same failure again, flushing what could not be written
            pass

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for tracker in list(self._trackers):
            self._guarded(tracker, "close")
        self._trackers = []


TORN_SUFFIX = ".torn"  # beside a metrics file: the torn last lines set aside from it


def set_aside_torn_line(path: str) -> None:
    """Before a run appends to a local metrics file whose last line was cut short (a write
    that failed on a full disk, a kill): move those bytes to `<path>.torn` (appended there) and
    cut the file back to its last whole line, saying so in one warning line. Appended to as it
    was, the torn line and the next record would make one line no reader parses. A URL is left
    as it is (an object store cannot cut a file)."""
    if paths.is_url(path):
        return
    file = Path(paths.local(path))
    if not file.is_file():
        return
    with file.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0 or _last_byte(f, size) == b"\n":
            return
        whole = _end_of_last_line(f, size)
        f.seek(whole)
        torn = f.read()
        aside = file.with_name(file.name + TORN_SUFFIX)
        with aside.open("ab") as kept:
            kept.write(torn + b"\n")
        f.truncate(whole)
    warn(
        f"warning: {path} ended in a torn line ({len(torn)} bytes cut short: a write that "
        f"failed or a kill); moved it to {aside}, appending after the last whole record"
    )


def _last_byte(f: IO[bytes], size: int) -> bytes:
    f.seek(size - 1)
    return f.read(1)


def _end_of_last_line(f: IO[bytes], size: int, block: int = 1 << 16) -> int:
    """The offset just after the last newline of an open file of `size` bytes (0: none)."""
    end = size
    while end > 0:
        start = max(end - block, 0)
        f.seek(start)
        found = f.read(end - start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


def device_memory(devices: Any) -> dict[str, int | None]:
    """Bytes in use now and at peak on the fullest of `devices` (jax devices), None where the
    backend keeps no allocator statistics (XLA:CPU)."""
    stats = [s for s in (d.memory_stats() for d in devices) if s]
    in_use = [s["bytes_in_use"] for s in stats if "bytes_in_use" in s]
    peak = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return {
        "memory_bytes_in_use": max(in_use) if in_use else None,
        "memory_peak_bytes": max(peak) if peak else None,
    }


def format_duration(seconds: float) -> str:
    """h:mm:ss."""
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def format_rate(tokens_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit}"
    return f"{tokens_per_s:.0f}"


def progress_line(
    step: int, steps: int, loss: float, grad_norm: float, step_time_s: float, tokens_per_s: float
) -> str:
    """One console line: step, loss, grad norm, throughput, step time and time left."""
    eta = format_duration((steps - step) * step_time_s)
    return (
        f"step {step:>{len(str(steps))}}/{steps} | loss {loss:.4f} | gnorm {grad_norm:.3f} | "
        f"{format_rate(tokens_per_s)} tok/s | {step_time_s * 1e3:.1f} ms/step | eta {eta}"
    )
