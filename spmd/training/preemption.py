"""Stop requests: SIGTERM or SIGINT asks the training loop to finish its step, save, exit 0.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before killing a job,
and Ctrl-C sends SIGINT. While a `StopSignals` block is open, the first such signal is only
recorded; the loop asks spmd.training.job.AgreedStop after each step, which turns it into the
step every process of the job stops after. The previous handlers come back at once,
so a second signal acts as usual (SIGINT raises KeyboardInterrupt, SIGTERM ends the process).
spmd.train ends a run that a second SIGINT interrupts with `interrupted_line` and status 130,
not waiting for a save in flight: orbax writes a step under a name of its own and renames it
once complete, so the step cut short is given up and the steps saved before stay whole.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
INTERRUPTED_EXIT = 128 + signal.SIGINT  # 130, as a shell reports a process SIGINT ended


def interrupted_line(checkpoint_dir: str) -> str:
    """The one line of a run that a second SIGINT ended: the saves it cut short (newer than
    the newest good step: partial, or complete without a manifest) and the newest complete,
    verified step of `checkpoint_dir`, the one a resume continues from."""
    from spmd.io import checkpoint

    if not checkpoint_dir:
        return "SIGINT again: stopped at once; nothing was saved (no checkpoint folder)"
    kept = checkpoint.newest_verified(checkpoint_dir)
    partial = [int(n.split(".")[0]) for n in checkpoint.interrupted_saves(checkpoint_dir)]
    cut = sorted(
        s
        for s in {*partial, *checkpoint.complete_steps(checkpoint_dir)}
        if kept is None or s > kept
    )
    cut_text = (
        f", cutting short the save of step {', '.join(map(str, cut))} (never read: a resume "
        f"leaves it aside)"
        if cut
        else ""
    )
    keeps = (
        f"{checkpoint_dir} holds no complete checkpoint"
        if kept is None
        else f"the last good checkpoint is step {kept} in {checkpoint_dir}, which the same "
        f"command continues from"
    )
    return f"SIGINT again: stopped at once{cut_text}; {keeps}"


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
