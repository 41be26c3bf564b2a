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

An eval is agreed on the same way, batch by batch: the first process to see a signal during
an eval publishes "stop this eval before batch b + MARGIN" under that eval's own key; every
process reads it before dispatching each batch, and waits for the loss of the batch two
before (which needs every process's part of it), so none is more than two batches ahead of
another. A cut eval's step is then the step every process stops after and saves.

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
EVAL_KEY = "spmd/stop_eval/"  # + the eval's number (every process runs the same evals)
HEARTBEAT_ENV = "SPMD_HEARTBEAT_DIR"  # set by spmd.launch: where each rank's heartbeat file is


class AgreedStop:
    """Where a run's stop requests become the step it stops after (see the module's text)."""

    def __init__(self, signals: StopSignals, client: Any = None, process_id: int = 0) -> None:
        self.signals = signals
        self.client = client  # the distributed runtime's client in a multi-process job, or None
        self.process_id = process_id
        self.target: int | None = None
        self.reason: str | None = None
        self._published: set[str] = set()  # the store keys this process has published under
        self._evals = 0  # evals begun: each agrees on its own cut (EVAL_KEY + number)
        self._batch = 0  # the current eval's next batch, over all its eval sets
        self.cut: tuple[str, str] | None = None  # (signal, where) of the eval cut last

    def stop_after(self, step: int) -> int | None:
        """The step this run stops after (and saves), once any process asked; None while none
        did. Call once per step, after dispatching `step`, on every process."""
        if self.target is not None:
            return self.target
        if self.client is None:
            if self.signals.received:
                self._agree(step, self.signals.received, "this process")
            return self.target
        published = self._publish_and_read(STOP_KEY, step)
        if published is None:
            return None
        target, process, signal_name = published
        if target < step:  # cannot happen within MARGIN; if it did, stop at once
            print(
                f"spmd: process {self.process_id} is already at step {step}, past the agreed "
                f"stop after step {target}; stopping here",
                file=sys.stderr,
                flush=True,
            )
            target = step
        self._agree(target, signal_name, f"process {process}")
        return self.target

    def begin_eval(self) -> None:
        """Call at the start of every eval, on every process."""
        self._evals += 1
        self._batch = 0

    def cut_eval(self) -> str | None:
        """Why the current eval ends before its next batch, once a stop reached a process and
        every process agrees on that batch; None while it goes on. Call before each batch
        (over all the eval's sets); in a job, wait first for the loss of the batch two back
        (the module's text)."""
        batch, self._batch, self.cut = self._batch, self._batch + 1, None
        if self.client is None:
            if self.signals.received:
                self.cut = (self.signals.received, "this process")
        else:
            self.cut = self._agreed_cut(batch)
        return f"{self.cut[0]} to {self.cut[1]}" if self.cut else None

    def _agreed_cut(self, batch: int) -> tuple[str, str] | None:
        published = self._publish_and_read(f"{EVAL_KEY}{self._evals}", batch)
        if published is None:
            return None
        target, process, signal_name = published
        return (signal_name, f"process {process}") if batch >= target else None

    def _publish_and_read(self, key: str, at: int) -> tuple[int, str, str] | None:
        """The agreed (step or batch, process, signal) under `key` in the job's store, after
        publishing `at` + MARGIN once if this process received a signal; None while no
        process did."""
        if self.signals.received and key not in self._published:
            self._published.add(key)
            value = f"{at + MARGIN} {self.process_id} {self.signals.received}"
            try:
                self.client.key_value_set(key, value)
            except Exception:  # another process published first: its value holds for all
                pass
        try:
            published = self.client.key_value_try_get(key)
        except Exception:  # not published yet (the store answers NOT_FOUND)
            return None
        target, process, signal_name = published.split()
        return int(target), process, signal_name

    def stop_now(self, step: int) -> str:
        """After an eval cut at `step` (every process cut the same eval): stop after `step`."""
        assert self.cut is not None
        self._agree(step, *self.cut)
        return self.cut[0]

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
