"""The processes of one job stop together and show that they are alive.

A stop signal reaches the processes of a job separately: a scheduler may signal one of them,
or each a little apart. If each decided alone, one would enter its checkpoint save (a
collective) while the others stepped on (another collective), and the job would deadlock.
`AgreedStop` turns any process's stop request into one step that every process stops after:

- one process: the step it has just dispatched;
- several: the first process to see a signal publishes "stop after step s + MARGIN" in the
  distributed runtime's key-value store (later publishers find the key taken); every process
  reads the key after dispatching each step, so all reach the same boundary and save that
  step together. MARGIN covers how far apart the processes' loops can be: a process waits for
  the previous step's metrics before it goes on, and those need every process's part of that
  step, so no process can be more than two steps ahead of another.

`Heartbeat` touches a file per process after each step, which `spmd.launch --hang-timeout`
watches: a process whose file stops changing is stuck (a dead peer, a collective that never
completes), and the launcher ends the job naming it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from spmd.training.preemption import StopSignals

MARGIN = 3  # steps between a stop request and the step every process stops after
STOP_KEY = "spmd/stop_after_step"
HEARTBEAT_ENV = "SPMD_HEARTBEAT_DIR"  # set by spmd.launch: where each rank's heartbeat file is


class AgreedStop:
    """Where a run's stop requests become the step it stops after (see the module's text)."""

    def __init__(self, signals: StopSignals, client: Any = None, process_id: int = 0) -> None:
        self.signals = signals
        self.client = client  # the distributed runtime's client in a multi-process job, or None
        self.process_id = process_id
        self.target: int | None = None
        self.reason: str | None = None
        self._published = False

    def stop_after(self, step: int) -> int | None:
        """The step this run stops after (and saves), once any process asked; None while none
        did. Call once per step, after dispatching `step`, on every process."""
        if self.target is not None:
            return self.target
        if self.client is None:
            if self.signals.received:
                self._agree(step, self.signals.received, "this process")
            return self.target
        if self.signals.received and not self._published:
            self._published = True
            value = f"{step + MARGIN} {self.process_id} {self.signals.received}"
            try:
                self.client.key_value_set(STOP_KEY, value)
            except Exception:  # another process published first: its step holds for all
                pass
        try:
            published = self.client.key_value_try_get(STOP_KEY)
        except Exception:  # not published yet (the store answers NOT_FOUND)
            return None
        target, process, signal_name = published.split()
        if int(target) < step:  # cannot happen within MARGIN; if it did, stop at once
            print(
                f"spmd: process {self.process_id} is already at step {step}, past the agreed "
                f"stop after step {target}; stopping here",
                file=sys.stderr,
                flush=True,
            )
            target = str(step)
        self._agree(int(target), signal_name, f"process {process}")
        return self.target

    def _agree(self, target: int, signal_name: str, where: str) -> None:
        self.target, self.reason = target, signal_name
        print(
            f"stop requested ({signal_name} to {where}): stopping after step {target} and saving "
            f"it",
            file=sys.stderr,
            flush=True,
        )


class Heartbeat:
    """A file per process whose modification time is its last step (when spmd.launch asked
    for one through SPMD_HEARTBEAT_DIR; otherwise nothing)."""

    def __init__(self, process_id: int) -> None:
        directory = os.environ.get(HEARTBEAT_ENV)
        self.path = Path(directory) / str(process_id) if directory else None

    def beat(self) -> None:
        if self.path is not None:
            self.path.touch()
