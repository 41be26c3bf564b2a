"""`python -m spmd.launch -n N [--devices-per-process D] -- COMMAND ...`: N local processes.

Starts N copies of COMMAND as the processes of one JAX job on this host: a free coordinator
port on 127.0.0.1 is chosen and handed to each copy through the environment (SPMD_COORDINATOR,
SPMD_NUM_PROCESSES, SPMD_PROCESS_ID, and SPMD_LOCAL_DEVICES when --devices-per-process is
given), which `spmd.parallel.distributed.initialize` reads. Every output line is prefixed with its
process rank. If one process fails, the others are terminated (SIGTERM, then SIGKILL after
--grace seconds) and the launcher exits with the first failure's status: never a hang.
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
import time


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


def parse_args(argv: list[str] | None) -> tuple[LaunchConfig, list[str]]:
    """(the launch config, the command each process runs)."""
    from spmd import config
    from spmd.errors import UsageError

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
    if cfg.devices_per_process < 0:
        raise UsageError(
            f"--devices-per-process {cfg.devices_per_process} must be >= 0 (0: the command decides)"
        )
    if not 0 <= cfg.grace < math.inf:  # NaN fails every comparison
        raise UsageError(f"--grace {cfg.grace} must be a finite number of seconds >= 0")
    if shutil.which(command[0]) is None:  # before any process starts (Popen would raise)
        raise UsageError(
            f"the command {command[0]!r} is not an executable file or on PATH; give a program "
            f"to run after --, e.g. -- python -m spmd.train"
        )
    return cfg, command


def start(cfg: LaunchConfig, command: list[str]) -> list[subprocess.Popen]:
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in range(cfg.num_processes):
        env = {
            **os.environ,
            "SPMD_COORDINATOR": coordinator,
            "SPMD_NUM_PROCESSES": str(cfg.num_processes),
            "SPMD_PROCESS_ID": str(rank),
            "PYTHONUNBUFFERED": "1",
        }
        if cfg.devices_per_process:
            env["SPMD_LOCAL_DEVICES"] = str(cfg.devices_per_process)
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return procs


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process group, then SIGKILL what is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)


def supervise(procs: list[subprocess.Popen], grace: float) -> int:
    """Relay output with rank prefixes until all exit; on the first failure stop the rest."""
    selector = selectors.DefaultSelector()
    for rank, proc in enumerate(procs):
        os.set_blocking(proc.stdout.fileno(), False)
        selector.register(proc.stdout, selectors.EVENT_READ, rank)
    partial = {rank: b"" for rank in range(len(procs))}
    failure = 0
    while selector.get_map():
        for key, _ in selector.select(timeout=0.2):
            rank = key.data
            chunk = key.fileobj.read()
            if not chunk:
                selector.unregister(key.fileobj)
                chunk = b"\n" if partial[rank] else b""
            *lines, partial[rank] = (partial[rank] + chunk).split(b"\n")
            for line in lines:
                sys.stdout.write(f"[{rank}] {line.decode(errors='replace')}\n")
            sys.stdout.flush()
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed and not failure:
            failure = failed[0]
            dead = [r for r, c in enumerate(codes) if c not in (None, 0)]
            print(
                f"spmd.launch: process {dead[0]} exited with status {failure}; stopping the others",
                file=sys.stderr,
                flush=True,
            )
            stop(procs, grace)
            break
    for proc in procs:
        proc.wait()
    return failure or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    from spmd.errors import run_command

    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    cfg, command = parse_args(argv)
    procs = start(cfg, command)
    try:
        return supervise(procs, cfg.grace)
    except KeyboardInterrupt:
        stop(procs, cfg.grace)
        return 130


if __name__ == "__main__":
    sys.exit(main())
