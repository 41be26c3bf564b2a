"""Multi-process runs with real processes (CPU, gloo, spmd.launch): 2 processes x 4 devices
train exactly like 1 process x 8 devices, and checkpoints move between process counts."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.cli import CACHE_HOME, ROOT, records

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
    """Run spmd.train on `processes` x (8 / processes) CPU devices; the train losses by step."""
    metrics = tmp / f"{name}.jsonl"
    command = [sys.executable, "-m", "spmd.train", *RUN, "--metrics", str(metrics), *args]
    if processes > 1:
        command = [
            sys.executable,
            "-m",
            "spmd.launch",
            "-n",
            str(processes),
            "--devices-per-process",
            str(8 // processes),
            "--",
            *command,
        ]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "XDG_CACHE_HOME": CACHE_HOME,
        "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
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


@pytest.mark.parametrize("mesh", ["dp=8", "dp=2,tp=4"])
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
