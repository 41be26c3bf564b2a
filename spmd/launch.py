"""`python -m spmd.launch -n N [--devices-per-process D] -- COMMAND ...`: N local processes.

Starts N copies of COMMAND as the processes of one JAX job on this host: a free coordinator
port on 127.0.0.1 is chosen and handed to each copy through the environment (SPMD_COORDINATOR,
SPMD_NUM_PROCESSES, SPMD_PROCESS_ID, and SPMD_LOCAL_DEVICES when --devices-per-process is
given), which `spmd.parallel.distributed.initialize` reads. Every output line is prefixed with its
process rank. The launcher owns its processes and never leaves one behind:

- one fails: the others get SIGTERM, then SIGKILL after --grace seconds; the launcher exits
  with the first failure's status;
- the launcher gets SIGTERM or SIGINT: it forwards it to every process (they agree on a step,
  save it and exit 0: spmd.training.job) and waits up to --stop-timeout seconds for them, then
  kills what is left; a second signal kills them at once; the exit status is theirs;
- a process makes no step for --hang-timeout seconds (a heartbeat file it touches after each
  step stops changing: a dead peer, a collective that never completes): the job is stopped
  with a line naming the rank that stopped (a stopped process first, else the oldest step),
  exit status 124; the processes' own peer watch (spmd.parallel.peer_watch, and JAX's heartbeat
  deadline after it) is set beyond it, so this line comes first;
- the launcher itself is killed (even SIGKILL): Linux sends each process SIGTERM
  (PR_SET_PDEATHSIG), so none is orphaned, and each stops after an agreed step and saves it
  (spmd.train survives its lost console: spmd.log.survive_a_lost_console).

-n and --devices-per-process are bounded by what the host can run, before anything starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The processes of the job."""

    num_processes: int = 0  # processes to start
    devices_per_process: int = 0  # simulated CPU devices in each process (0: the command decides)
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL when stopping the others
    # seconds the processes get to reach the agreed step, save and exit after a forwarded signal
    stop_timeout: float = 300.0
    # seconds without a step (after the first) before a process counts as hung (0: never)
    hang_timeout: float = 900.0


def parse_args(argv: list[str] | None) -> tuple[LaunchConfig, list[str]]:
    """(the launch config, the command each process runs)."""
    from spmd.errors import UsageError
    from spmd.run import config

    command = config.Positional("command", argparse.REMAINDER, "the command to run, after --")
    resolved = config.resolve(
        argv,
        {"launch": LaunchConfig},
        "python -m spmd.launch",
        description=__doc__.split("\n\n")[0],
        positional=command,
        short={"num_processes": "-n"},
    )
    cfg, command = resolved["launch"], resolved["command"]
    command = command[1:] if command and command[0] == "--" else command
    if not command:
        raise UsageError("give the command to run after --, e.g. -- python -m spmd.train")
    if cfg.num_processes < 1:
        raise UsageError(f"-n {cfg.num_processes} must be a positive number of processes")
    limit = process_limit()
    if cfg.num_processes > limit:  # before any process starts
        raise UsageError(
            f"-n {cfg.num_processes}: this host can hold at most {limit} processes (its memory at "
            f"{PROCESS_BYTES // 2**20} MiB each, its open-file and process limits); give fewer"
        )
    if cfg.devices_per_process < 0:
        raise UsageError(
            f"--devices-per-process {cfg.devices_per_process} must be >= 0 (0: the command decides)"
        )
    if cfg.devices_per_process:
        from spmd.parallel.mesh import check_simulated

        check_simulated(cfg.devices_per_process, f"--devices-per-process {cfg.devices_per_process}")
    for name in ("grace", "stop_timeout", "hang_timeout"):
        if not 0 <= getattr(cfg, name) < math.inf:  # NaN fails every comparison
            raise UsageError(
                f"--{name.replace('_', '-')} {getattr(cfg, name)} must be a finite number of "
                f"seconds >= 0"
            )
    if shutil.which(command[0]) is None:  # before any process starts (Popen would raise)
        raise UsageError(
            f"the command {command[0]!r} is not an executable file or on PATH; give a program "
            f"to run after --, e.g. -- python -m spmd.train"
        )
    return cfg, command


# What one process of a job takes at least: a Python interpreter with JAX imported.
PROCESS_BYTES = 256 * 2**20
RESERVED_FILES = 64  # the launcher's own open files, beside one pipe per process


def process_limit() -> int:
    """The most processes this host can run for one job: by its memory (PROCESS_BYTES each),
    the launcher's open-file limit (a pipe per process) and the user's process limit."""
    import resource

    from spmd.observe.capacity import host_memory

    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limits = [files - RESERVED_FILES if files != resource.RLIM_INFINITY else 2**20]
    memory = host_memory()
    if memory:
        limits.append(memory // PROCESS_BYTES)
    processes = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if processes != resource.RLIM_INFINITY:
        limits.append(processes)
    return max(1, min(limits))


def start(cfg: LaunchConfig, command: list[str], heartbeats: str) -> list[subprocess.Popen]:
    """The N processes, each in its own process group (a signal to the launcher's terminal
    group reaches them only through the launcher, once), each told where its heartbeat goes."""
    from spmd.parallel.distributed import PEER_TIMEOUT_ENV
    from spmd.training.job import HEARTBEAT_ENV

    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in range(cfg.num_processes):
        env = {
            **os.environ,
            "SPMD_COORDINATOR": coordinator,
            "SPMD_NUM_PROCESSES": str(cfg.num_processes),
            "SPMD_PROCESS_ID": str(rank),
            "PYTHONUNBUFFERED": "1",
            HEARTBEAT_ENV: heartbeats,
        }
        if cfg.hang_timeout:  # the processes' peer watch after the launcher's (it watches steps)
            env[PEER_TIMEOUT_ENV] = str(int(cfg.hang_timeout) + PEER_TIMEOUT_MARGIN_S)
        if cfg.devices_per_process:
            env["SPMD_LOCAL_DEVICES"] = str(cfg.devices_per_process)
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )
        )
    return procs


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, however it dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process group, then SIGKILL what is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)


class Supervisor:
    """Relays the processes' output with rank prefixes until all have exited, and ends the job
    on a failure, a forwarded stop that takes too long, or a hung process."""

    def __init__(self, procs: list[subprocess.Popen], cfg: LaunchConfig, heartbeats: str) -> None:
        self.procs, self.cfg, self.heartbeats = procs, cfg, Path(heartbeats)
        self.status = 0  # the job's exit status once something ended it early
        self.signals: list[int] = []  # the stop signals the launcher received, in order
        self.stop_deadline: float | None = None

    def on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def run(self) -> int:
        selector = selectors.DefaultSelector()
        outputs = {}  # rank -> the process's stdout pipe (Popen(stdout=PIPE) made each)
        for rank, proc in enumerate(self.procs):
            assert proc.stdout is not None
            outputs[rank] = proc.stdout
            os.set_blocking(proc.stdout.fileno(), False)
            selector.register(proc.stdout, selectors.EVENT_READ, rank)
        partial = {rank: b"" for rank in range(len(self.procs))}
        while selector.get_map():
            for key, _ in selector.select(timeout=0.2):
                rank = key.data
                chunk = outputs[rank].read()
                if not chunk:
                    selector.unregister(key.fileobj)
                    chunk = b"\n" if partial[rank] else b""
                *lines, partial[rank] = (partial[rank] + chunk).split(b"\n")
                for line in lines:
                    sys.stdout.write(f"[{rank}] {line.decode(errors='replace')}\n")
                sys.stdout.flush()
            self.check()
        for proc in self.procs:
            proc.wait()
        return self.status or next((p.returncode for p in self.procs if p.returncode), 0)

    def check(self) -> None:
        """One look at the job: signals received, failures, the stop deadline, heartbeats."""
        if len(self.signals) == 1 and self.stop_deadline is None:
            self.forward(self.signals[0])
        elif len(self.signals) > 1 and not self.status:
            say(f"second {signal.Signals(self.signals[1]).name}: killing every process now")
            self.status = 128 + self.signals[1]
            stop(self.procs, 0)
        codes = [p.poll() for p in self.procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and not self.status:
            rank, code = failed[0]
            self.status = code if code > 0 else 128 - code  # killed by a signal: 128 + signal
            say(f"process {rank} exited with status {self.status}; stopping the others")
            stop(self.procs, self.cfg.grace)
        if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
            if any(c is None for c in codes):
                say(f"processes still running {self.cfg.stop_timeout:g} s after the stop: killed")
                self.status = self.status or 128 + signal.SIGKILL
                stop(self.procs, 0)
        hung = self.hung_rank()
        if hung is not None and not self.status:
            why = "a dead peer or a collective that never completes"
            if _stopped(self.procs[hung].pid):
                why = "it is stopped: SIGSTOP or a debugger"
            say(
                f"process {hung} made no step for {self.cfg.hang_timeout:g} s ({why}); stopping "
                f"the job"
            )
            self.status = HUNG_EXIT
            stop(self.procs, self.cfg.grace)

    def forward(self, signum: int) -> None:
        live = [p for p in self.procs if p.poll() is None]
        say(
            f"{signal.Signals(signum).name}: forwarded to {len(live)} process(es); they stop "
            f"after one agreed step and save it (up to {self.cfg.stop_timeout:g} s; send it "
            f"again to kill them at once)"
        )
        for proc in live:
            _signal_group(proc, signum)
        self.stop_deadline = time.monotonic() + self.cfg.stop_timeout

    def hung_rank(self) -> int | None:
        """The rank that stopped the job once some heartbeat is older than --hang-timeout
        (after the first step); a process that has exited is not hung. One stuck rank soon
        stalls the others in their next collective, so every heartbeat goes stale: the one
        named is a stopped process (SIGSTOP, a debugger) if any, else the one whose last step
        is the oldest, the first to stop."""
        if not self.cfg.hang_timeout or self.stop_deadline is not None:
            return None
        now, beats = time.time(), {}
        for rank, proc in enumerate(self.procs):
            beat = self.heartbeats / str(rank)
            if proc.poll() is None and beat.exists():
                beats[rank] = beat.stat().st_mtime
        if not beats or now - min(beats.values()) <= self.cfg.hang_timeout:
            return None
        stopped = [rank for rank in beats if _stopped(self.procs[rank].pid)]
        return stopped[0] if stopped else min(beats, key=lambda rank: beats[rank])


HUNG_EXIT = 124  # as `timeout` reports a command it ended
PEER_TIMEOUT_MARGIN_S = 60


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T: SIGSTOP; t: a debugger), read from /proc
    (False where there is none)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def say(text: str) -> None:
    print(f"spmd.launch: {text}", file=sys.stderr, flush=True)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:  # it has just exited
        pass


def main(argv: list[str] | None = None) -> int:
    from spmd.errors import run_command

    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    cfg, command = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spmd-heartbeats-") as heartbeats:
        procs = start(cfg, command, heartbeats)
        supervisor = Supervisor(procs, cfg, heartbeats)
        previous = {sig: signal.signal(sig, supervisor.on_signal) for sig in STOP_SIGNALS}
        try:
            return supervisor.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            stop(procs, 0)  # nothing outlives the launcher, whatever happened above


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
