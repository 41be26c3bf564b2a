"""The processes of a multi-process job name a peer that goes silent, in one line.

JAX's coordination service notices a process that stops sending heartbeats (SIGSTOP, a kill,
a lost host) once its heartbeat deadline passes, and then ends every other process with
status 134 and a C++ stack dump. Its hook for doing something else (the client's
missed-heartbeat callback) cannot be used from Python in this JAX version: the status it
passes does not convert, and the process terminates. So each process of the job runs two
daemon threads:

- a pulse, every `timeout_s / PULSES` seconds: it bumps this process's counter in the
  distributed runtime's key-value store and reads every process's counter;
- a watch: a peer whose counter has not moved for `timeout_s` seconds, or a key-value store
  that has not answered for that long (it lives in process 0, the coordinator), ends this
  process with one `error:` line naming that rank and exit status STOPPED_EXIT.

spmd.parallel.distributed gives JAX a heartbeat deadline beyond `timeout_s`, so this line
comes first. The counter is a thread's, not the training loop's: a peer that is alive but
stuck (a collective that never completes) is for spmd.launch --hang-timeout to name, which
watches steps. At Python's exit (atexit, before JAX's own shutdown, which disconnects the
store) a process stops its threads and leaves EXITED as its count: a peer still at work (a
final save, a summary) does not name a process that ended on purpose.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any

PREFIX = "spmd/alive/"  # key-value store keys: PREFIX + rank -> that process's pulse count
PULSES = 4  # pulses per timeout: a peer misses this many in a row before it is named
STOPPED_EXIT = 124  # as spmd.launch ends a hung job (and `timeout` a command it ended)
EXITED = "exited"  # the count of a process that has reached Python's exit
LEAVE_WAIT_S = 5.0


class PeerWatch:
    """Names the first peer (or the coordinator) silent for `timeout_s` seconds and ends this
    process (see the module's text). `client`: the distributed runtime's client."""

    def __init__(self, client: Any, process_id: int, num_processes: int, timeout_s: float):
        self.client, self.process_id, self.timeout_s = client, process_id, timeout_s
        now = time.monotonic()
        # when each peer's counter last moved, and its last count
        self.heard = {rank: now for rank in range(num_processes) if rank != process_id}
        self.counts: dict[int, str] = {}
        self.answered = now  # when the key-value store last answered a pulse
        self.stopped = threading.Event()
        self._setting = threading.Lock()  # the last count set is EXITED, once `leave` ran

    def start(self) -> None:
        atexit.register(self.leave)
        for target in (self._pulse, self._watch):
            threading.Thread(target=target, name=f"spmd_peer{target.__name__}", daemon=True).start()

    def leave(self) -> None:
        """Stop watching, and tell the peers this process ended on purpose (unless a pulse
        has been stuck on the store for LEAVE_WAIT_S: the exit does not wait on it)."""
        self.stopped.set()
        if self._setting.acquire(timeout=LEAVE_WAIT_S):
            try:
                self._set(EXITED)
            finally:
                self._setting.release()

    def _set(self, count: str) -> bool:
        """This process's count in the store: whether the store took it."""
        try:
            self.client.key_value_set(f"{PREFIX}{self.process_id}", count, allow_overwrite=True)
        except Exception:  # the store is gone or going: the watch decides when to speak
            return False
        return True

    def silent(self, now: float) -> str | None:
        """The line naming who has been silent for longer than the timeout, or None."""
        silent = [rank for rank, heard in self.heard.items() if now - heard > self.timeout_s]
        if now - self.answered > self.timeout_s:
            silent = [0]  # the key-value store is process 0's: nothing can be heard of the rest
        if not silent:
            return None
        who = f"process {silent[0]}" + (" (the job's coordinator)" if silent[0] == 0 else "")
        return (
            f"{who} stopped answering: silent for {self.timeout_s:g} s (stopped, killed or its "
            f"host lost; --peer-timeout); process {self.process_id} ends the job"
        )

    def _pulse(self) -> None:
        count = 0
        while not self.stopped.wait(self.timeout_s / PULSES):
            count += 1
            with self._setting:
                if self.stopped.is_set() or not self._set(str(count)):
                    continue
            try:
                seen = self.client.key_value_dir_get(PREFIX)
            except Exception:
                continue
            self.hear(seen, time.monotonic())

    def hear(self, seen: list[tuple[str, str]], now: float) -> None:
        """Take the store's answer at `now`: every process's count, under its key."""
        self.answered = now
        for key, value in seen:
            rank = int(key.rpartition("/")[2])
            if value == EXITED:  # ended on purpose: no longer watched
                self.heard.pop(rank, None)
            elif rank in self.heard and self.counts.get(rank) != value:
                self.counts[rank], self.heard[rank] = value, now

    def _watch(self) -> None:
        while not self.stopped.wait(self.timeout_s / PULSES):
            line = self.silent(time.monotonic())
            if line is not None and not self.stopped.is_set():
                print(f"error: {line}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(STOPPED_EXIT)
