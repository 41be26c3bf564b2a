"""Run metrics: the JSONL record stream of docs/contracts.md and the console progress line.

Records are dicts with a `kind`: one "config" first, one "train" per logged step, "eval"
records, one "summary" at the end. Values are plain JSON numbers and strings; times are
seconds, throughput tokens per second.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
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
