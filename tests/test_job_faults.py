"""Faults of a job's processes, with real processes where it matters: a peer that goes silent
outside spmd.launch is named in one line (spmd.parallel.peer_watch), and a stop signal during
an eval cuts it at a batch every process agrees on (spmd.training.job.AgreedStop), then saves
the eval's step."""

import os
import signal
import subprocess
import sys
import time

from tests.test_faults import ENV, ROOT, RUN, read_until

JOIN = """
import sys, time
from spmd.parallel import distributed
coordinator, rank = sys.argv[1], int(sys.argv[2])
distributed.initialize(coordinator, 2, rank, timeout_s=30, peer_timeout_s=2)
print("joined", flush=True)
time.sleep(60)  # the job's work: a stopped peer stalls it
"""


def test_a_stopped_peer_outside_the_launcher_is_named_in_one_line():
    """Two processes joined by --coordinator flags alone (as under SLURM: no launcher): SIGSTOP
    of rank 1 ends rank 0 within seconds of --peer-timeout with one line naming rank 1, exit
    124, before JAX's own heartbeat deadline would abort it (status 134, a C++ stack dump)."""
    from spmd.launch import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JOIN, coordinator, str(rank)],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline() == "joined\n", proc.stderr.read()
        os.kill(procs[1].pid, signal.SIGSTOP)
        started = time.monotonic()
        err = procs[0].communicate(timeout=30)[1]
        assert time.monotonic() - started < 10
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[0].returncode == 124, err
    last = err.strip().splitlines()[-1]
    assert last == (
        "error: process 1 stopped answering: silent for 2 s (stopped, killed or its host lost; "
        "--peer-timeout); process 0 ends the job"
    ), err
    assert "Check failure" not in err and "Traceback" not in err, err


def test_the_peer_watch_names_the_silent_rank_or_the_coordinator():
    """On its own clock, without threads: a peer whose count stops moving is named once the
    timeout passes, one that reached its exit is not, and a store that stops answering names
    process 0, which holds it."""
    from spmd.parallel.peer_watch import EXITED, PREFIX, PeerWatch

    watch = PeerWatch(client=None, process_id=1, num_processes=4, timeout_s=10)
    t0 = watch.answered
    counts = {0: "1", 1: "1", 2: "1", 3: "1"}
    watch.hear([(f"{PREFIX}{rank}", count) for rank, count in counts.items()], t0 + 1)
    counts.update({0: "2", 3: EXITED})  # 0 moves on; 2 stops; 3 ends on purpose
    watch.hear([(f"{PREFIX}{rank}", count) for rank, count in counts.items()], t0 + 8)
    assert watch.silent(t0 + 10) is None
    assert watch.silent(t0 + 12).startswith("process 2 stopped answering: silent for 10 s")
    counts[2] = "2"
    watch.hear([(f"{PREFIX}{rank}", count) for rank, count in counts.items()], t0 + 12)
    assert watch.silent(t0 + 17) is None  # 3 is never named
    line = watch.silent(t0 + 23)  # nothing answered since 12 s: the store is process 0's
    assert line.startswith("process 0 (the job's coordinator) stopped answering"), line
    assert line.endswith("process 1 ends the job"), line


def test_a_stop_during_eval_cuts_it_and_saves_that_step(tmp_path):
    """SIGTERM during an eval of 146829 batches (minutes): the eval stops at the next batch,
    the run stops after the eval's step, saves it and exits 0 within seconds."""
    checkpoints = tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, "-m", "spmd.train", *RUN, "--mesh", "dp=2", "--devices", "2"]
        + ["--steps", "2000", "--eval-every", "2", "--eval-fraction", "0.5"]
        + ["--eval-batches", "146829", "--checkpoint-dir", str(checkpoints)],
        cwd=ROOT,
        env={**ENV, "SPMD_RUNS_DIR": "none"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    read_until(proc, r"^step +2/", lines)  # its eval begins
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    out = "".join(lines) + proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    assert time.monotonic() - started < 15
    assert "eval at step 2 cut short by SIGTERM to this process" in out, out[-3000:]
    assert "stopped after step 2 (SIGTERM); checkpoint saved" in out, out[-3000:]
    assert [p.name for p in checkpoints.iterdir() if p.name.isdigit()] == ["2"]


class Store:
    """The distributed runtime's key-value store, as AgreedStop uses it, for processes that
    share this object."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def key_value_set(self, key: str, value: str) -> None:
        if key in self.values:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.values[key] = value

    def key_value_try_get(self, key: str) -> str:
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


def test_the_processes_of_a_job_cut_an_eval_at_the_same_batch():
    """Rank 1 is signalled before its batch 5 while rank 0 is two batches ahead (the most the
    eval's wait allows): both cut the eval before batch 8 (5 + MARGIN), a later signal to
    rank 0 does not move the cut, and both stop after the eval's step."""
    from spmd.training.job import AgreedStop
    from spmd.training.preemption import StopSignals

    store = Store()
    stops = [AgreedStop(StopSignals(), store, rank) for rank in (0, 1)]
    for stop in stops:
        stop.begin_eval()
    cuts: dict[int, int] = {}

    def dispatch(rank: int, batch: int) -> None:  # each rank's batches come in order
        if rank not in cuts and stops[rank].cut_eval():
            cuts[rank] = batch

    for batch in range(7):
        dispatch(0, batch)
    for batch in range(5):
        dispatch(1, batch)
    stops[1].signals.received = "SIGTERM"
    for batch in range(5, 20):
        dispatch(1, batch)
        dispatch(0, batch + 2)
        stops[0].signals.received = "SIGINT"  # a second signal, elsewhere, later
    assert cuts == {0: 8, 1: 8}
    assert [stop.stop_now(2) for stop in stops] == ["SIGTERM", "SIGTERM"]
    assert [stop.stop_after(3) for stop in stops] == [2, 2]
