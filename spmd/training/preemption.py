"""Stop requests: SIGTERM or SIGINT asks the training loop to finish its step, save, exit 0.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before killing a job,
and Ctrl-C sends SIGINT. While a `StopSignals` block is open, the first such signal is only
recorded; the loop asks spmd.training.job.AgreedStop after each step, which turns it into the
step every process of the job stops after. The previous handlers come back at once,
so a second signal acts as usual (SIGINT raises KeyboardInterrupt, SIGTERM ends the process).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager: while open, `received` is the name of the first stop signal or None."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers need the main thread
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        self._restore()
        print(
            f"received {self.received}: the run stops at the next step boundary that every "
            f"process agrees on and saves that step (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
