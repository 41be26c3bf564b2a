"""Multi-process runs with real processes (CPU, gloo, spmd.launch): 2 processes x 4 devices
train exactly like 1 process x 8 devices, and checkpoints move between process counts."""

import importlib.util
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from spmd.launch import free_port
from tests.cli import CACHE_HOME, ROOT, records, train_in_process

RUN = (
    "--model",
    "tiny",
    "--steps",
    "6",
    "--batch",
    "16",
    "--seq-len",
    "32",
    "--warmup",
    "2",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--eval-batches",
    "1",
)


def train(tmp, name: str, processes: int, *args: str) -> list[float]:
    """Run spmd.train on `processes` x (8 / processes) CPU devices; the train losses by step.
    One process is this test process (tests/cli.train_in_process), several are real ones."""
    metrics = tmp / f"{name}.jsonl"
    args = (*RUN, "--metrics", str(metrics), *args)
    if processes == 1:
        result = train_in_process(*args)
    else:
        per_process = ("-n", str(processes), "--devices-per-process", str(8 // processes))
        command = [sys.executable, "-m", "spmd.launch", *per_process, "--"]
        command += [sys.executable, "-m", "spmd.train", *args]
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(ROOT),
            "XDG_CACHE_HOME": CACHE_HOME,
            "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
        result = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if processes > 1:  # only process 0 reports
        assert "[0] step 6/6" in result.stdout or "[0] step 3/6" in result.stdout
        assert "[1] step" not in result.stdout
    return {r["step"]: r["loss"] for r in records(metrics) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process x 8 devices, fsdp=8, checkpoints at steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("multihost")
    losses = train(
        tmp,
        "reference",
        1,
        "--mesh",
        "fsdp=8",
        "--devices",
        "8",
        "--checkpoint-dir",
        str(tmp / "one-process"),
        "--checkpoint-every",
        "3",
    )
    return tmp, losses


def assert_same(losses: dict, reference: dict) -> None:
    steps = sorted(losses)
    got, want = np.array([losses[s] for s in steps]), np.array([reference[s] for s in steps])
    assert np.max(np.abs(got - want) / want) <= 1e-4, (steps, got, want)


# dp=2,tp=4 over two processes is the resume test's last leg (tp across them, --dcn-mesh tp=2)
@pytest.mark.parametrize("mesh", ["dp=8"])
def test_two_processes_match_one(reference, mesh):
    tmp, want = reference
    losses = train(tmp, mesh, 2, "--mesh", mesh)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert_same(losses, want)


def test_checkpoint_of_two_processes_resumes_in_one_and_back(reference):
    tmp, want = reference
    # 2 processes x 4 devices (fsdp crosses the process boundary) stop after step 3
    two = tmp / "two-processes"
    first = train(
        tmp, "two-first", 2, "--mesh", "fsdp=8", "--checkpoint-dir", str(two), "--stop-after", "3"
    )
    assert sorted(first) == [1, 2, 3]
    assert_same(first, want)
    # ... and 1 process x 8 devices finishes the run from that checkpoint
    rest = train(
        tmp,
        "one-rest",
        1,
        "--mesh",
        "dp=2,fsdp=4",
        "--devices",
        "8",
        "--checkpoint-dir",
        str(two),
        "--resume",
    )
    assert sorted(rest) == [4, 5, 6]
    assert_same(rest, want)
    assert (two / "3" / "manifest.json").is_file()  # written once, by process 0
    # the reverse: the 1-process checkpoint resumed by 2 processes, tp across them, with bytes of
    # step 6 flipped: both processes set it aside (process 0 verifies, the other follows) and
    # resume from step 3
    one = tmp / "one-process-at-3"
    shutil.copytree(tmp / "one-process", one)
    data = max((one / "6" / "state").rglob("d/*"), key=lambda path: path.stat().st_size)
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))
    back = train(
        tmp,
        "two-rest",
        2,
        "--mesh",
        "dp=2,tp=4",
        "--dcn-mesh",
        "tp=2",
        "--checkpoint-dir",
        str(one),
        "--resume",
    )
    assert sorted(back) == [4, 5, 6]
    assert_same(back, want)
    assert (one / "6.damaged").is_dir()


# -- joining a job through JAX's own cluster detection --------------------------------------

DETECTED_BY_JAX = (
    *("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    *("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    *("OMPI_COMM_WORLD_LOCAL_RANK", "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"),
    *("SPMD_COORDINATOR", "SPMD_NUM_PROCESSES", "SPMD_PROCESS_ID", "SPMD_LOCAL_DEVICES"),
)


def srun_task(rank: int, tasks: int, port: int) -> dict[str, str]:
    """The variables srun gives task `rank` of a one-node step (JAX reads these)."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": str(tasks),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "JAX_COORDINATOR_PORT": str(port),  # JAX's own override of the port it derives
    }


def test_spmd_joins_the_clusters_that_jax_detects(monkeypatch):
    from spmd.errors import UsageError
    from spmd.parallel import distributed

    for name in DETECTED_BY_JAX:
        monkeypatch.delenv(name, raising=False)
    assert distributed.detected_cluster() is None
    for name, value in srun_task(1, 2, 1234).items():
        monkeypatch.setenv(name, value)
    assert distributed.detected_cluster() == ("Slurm", 2)
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a single task runs as a plain single process
    assert distributed.detected_cluster() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")  # four tasks, but not started by srun
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    assert distributed.detected_cluster() is None
    with pytest.raises(UsageError, match="SLURM_NTASKS=4: this process is one of 4, but JAX"):
        distributed.initialize()  # rather than four runs each training alone
    monkeypatch.delenv("SLURM_NTASKS")

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # Open MPI 5: JAX 0.10 does not detect it
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert distributed.detected_cluster() is None
    with pytest.raises(UsageError, match="OMPI_COMM_WORLD_SIZE=2: .* --num-processes 2"):
        distributed.initialize()
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.0.0.1:34911")  # Open MPI 4
    assert distributed.detected_cluster() == ("Ompi", 2)
    for name in DETECTED_BY_JAX:
        monkeypatch.delenv(name, raising=False)

    # Kubernetes: every pod has KUBERNETES_SERVICE_HOST; JAX is asked only in an Indexed Job's
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert distributed.detected_cluster() is None
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    if importlib.util.find_spec("kubernetes") is None:  # JAX needs it; without, it says so
        with pytest.warns(UserWarning, match=r"the `kubernetes` package is not\s+installed"):
            assert distributed.detected_cluster() is None


def test_two_srun_tasks_join_one_job_through_jax_s_slurm_detection(tmp_path):
    """No spmd.launch and no flags: two processes with the environment srun gives its tasks
    find each other through jax.distributed.initialize()'s own SLURM detection and train one
    fsdp=8 mesh over their 2 x 4 CPU devices."""
    env = {k: v for k, v in os.environ.items() if k not in DETECTED_BY_JAX}
    env |= {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": CACHE_HOME}
    metrics = tmp_path / "m.jsonl"
    command = [sys.executable, "-m", "spmd.train", *RUN, "--steps", "2", "--metrics", str(metrics)]
    command += ["--mesh", "fsdp=8", "--devices", "4"]
    port, tasks = free_port(), []
    for rank in range(2):
        log = (tmp_path / f"{rank}.log").open("w")
        task_env = {**env, **srun_task(rank, 2, port)}
        tasks.append(subprocess.Popen(command, cwd=ROOT, env=task_env, stdout=log, stderr=log))
    codes = [task.wait(timeout=300) for task in tasks]
    logs = [(tmp_path / f"{rank}.log").read_text() for rank in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "joined a Slurm job of 2 processes" in logs[0]
    assert "mesh fsdp=8 (8 x cpu)" in logs[0] and "step 2/2" in logs[0]
    assert "step 2/2" not in logs[1]  # only process 0 reports
    assert [r["step"] for r in records(metrics) if r["kind"] == "train"] == [1, 2]
