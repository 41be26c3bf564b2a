"""Faults with real processes (CPU, gloo, spmd.launch): a stop signal to one process, to both
half a second apart or to the launcher ends the job within a bounded time with every process
saving the same step and exiting 0; a process that makes no step is named and the job ended;
nothing outlives the launcher."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.cli import CACHE_HOME, ROOT, records

RUN = (
    *("--model", "tiny", "--mesh", "dp=4", "--batch", "8", "--seq-len", "16"),
    *("--warmup", "2", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1"),
)
ENV = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(ROOT),
    "XDG_CACHE_HOME": CACHE_HOME,
}
BOUND_S = 90  # the bound on how long a stopped job may take to end


def launch(*command: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "spmd.launch", "-n", "2", "--devices-per-process", "2", *extra]
        + ["--", *command],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(proc: subprocess.Popen, pattern: str, lines: list[str]) -> None:
    """Read the launcher's output into `lines` until a line matches `pattern`."""
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError("".join(lines[-40:]))


def ranks(launcher: subprocess.Popen) -> list[int]:
    """The pids of the launcher's two processes, by rank."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(launcher.pid)], capture_output=True, text=True
    ).stdout
    pids = sorted(int(p) for p in out.split())
    assert len(pids) == 2, out
    by_rank = {}
    for pid in pids:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        rank = next(int(e.split(b"=")[1]) for e in env if e.startswith(b"SPMD_PROCESS_ID="))
        by_rank[rank] = pid
    return [by_rank[0], by_rank[1]]


def finish(proc: subprocess.Popen, lines: list[str], started: float) -> str:
    out, _ = proc.communicate(timeout=BOUND_S)
    assert time.monotonic() - started < BOUND_S
    return "".join(lines) + out


def stopped_step(out: str) -> int:
    """The step both processes announced they stop after (they must agree)."""
    announced = {
        rank: int(step)
        for rank, step in re.findall(r"\[(\d)\] stop requested .* stopping after step (\d+)", out)
    }
    assert set(announced) == {"0", "1"} and len(set(announced.values())) == 1, out[-3000:]
    return next(iter(announced.values()))


@pytest.mark.parametrize("target", ["rank 1", "both, 0.5 s apart", "the launcher"])
def test_a_stop_signal_ends_the_job_at_one_saved_step(tmp_path, target):
    checkpoints = tmp_path / "ck"
    command = [sys.executable, "-m", "spmd.train", *RUN, "--steps", "2000"]
    command += ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1000"]
    command += ["--metrics", str(tmp_path / "m.jsonl")]
    launcher, lines = launch(*command), []
    read_until(launcher, r"\[0\] step +3/", lines)
    started = time.monotonic()
    rank0, rank1 = ranks(launcher)
    if target == "the launcher":
        launcher.send_signal(signal.SIGTERM)
    else:
        os.kill(rank1, signal.SIGTERM)
        if target.startswith("both"):
            time.sleep(0.5)
            os.kill(rank0, signal.SIGTERM)
    out = finish(launcher, lines, started)
    assert launcher.returncode == 0, out[-3000:]
    for pid in (rank0, rank1):  # nothing left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    step = stopped_step(out)
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [step]
    assert f"stopped after step {step}" in out
    if target == "rank 1":  # the saved step continues exactly where an unbroken run goes
        resumed = tmp_path / "resumed.jsonl"
        # the same --steps (the LR schedule's length), stopped two steps after the saved one
        two_more = ["--steps", "2000", "--stop-after", str(step + 2)]
        tail = [*two_more, "--checkpoint-dir", str(checkpoints), "--resume"]
        unbroken = tmp_path / "unbroken.jsonl"
        fresh = [*two_more, "--checkpoint-dir", str(tmp_path / "unbroken")]
        for extra, metrics in ((tail, resumed), (fresh, unbroken)):
            result = subprocess.run(
                [sys.executable, "-m", "spmd.train", *RUN, *extra, "--metrics", str(metrics)],
                cwd=ROOT,
                env=ENV,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, result.stderr[-3000:]
        losses = {
            name: {r["step"]: r["loss"] for r in records(path) if r["kind"] == "train"}
            for name, path in (("resumed", resumed), ("unbroken", unbroken))
        }
        after = [step + 1, step + 2]
        assert sorted(losses["resumed"]) == after
        np.testing.assert_allclose(
            [losses["resumed"][s] for s in after], [losses["unbroken"][s] for s in after], rtol=1e-5
        )


HANG = """
import os, pathlib, sys, time
beat = pathlib.Path(os.environ["SPMD_HEARTBEAT_DIR"]) / os.environ["SPMD_PROCESS_ID"]
for _ in range(3):  # three steps, then rank 1 hangs (a collective that never completes)
    beat.touch()
    time.sleep(0.2)
while True:  # rank 0 goes on stepping
    if os.environ["SPMD_PROCESS_ID"] == "0":
        beat.touch()
    time.sleep(0.2)
"""


def test_a_process_that_makes_no_step_ends_the_job_naming_it():
    launcher = launch(sys.executable, "-c", HANG, extra=("--hang-timeout", "2"))
    started = time.monotonic()
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 124, out
    assert "process 1 made no step for 2 s" in out
    assert time.monotonic() - started < 30


def test_a_signal_during_compile_ends_a_run_before_its_first_step(tmp_path):
    """A first SIGTERM before training starts is noted (the process is not killed mid-start)
    and ends the run with status 0 and a line saying nothing was trained."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "spmd.train", *RUN, "--steps", "50"]
        + ["--checkpoint-dir", str(tmp_path / "ck")],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    read_until(proc, r"^xla flags", lines)  # configured, not yet compiled
    proc.send_signal(signal.SIGTERM)
    out = finish(proc, lines, time.monotonic())
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM before the first step: stopping; nothing was trained or saved" in out
    assert not any((tmp_path / "ck").glob("[0-9]*"))


def test_a_killed_rank_ends_the_job_and_leaves_its_checkpoints_whole(tmp_path):
    """kill -9 of one training process: the launcher stops the other (SIGTERM, then SIGKILL
    after --grace), exits 128 + 9, and the steps saved before are intact (their manifests)."""
    checkpoints = tmp_path / "ck"
    command = [sys.executable, "-m", "spmd.train", *RUN, "--steps", "2000"]
    command += ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"]
    launcher, lines = launch(*command, extra=("--grace", "5")), []
    read_until(launcher, r"\[0\] step +5/", lines)
    started = time.monotonic()
    rank0, rank1 = ranks(launcher)
    os.kill(rank1, signal.SIGKILL)
    out = finish(launcher, lines, started)
    assert launcher.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert "process 1 exited with status 137; stopping the others" in out
    with pytest.raises(ProcessLookupError):
        os.kill(rank0, 0)
    verified = subprocess.run(
        [sys.executable, "-m", "spmd.checkpoint", "verify", str(checkpoints)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert ": ok:" in verified.stdout
