"""Checkpoints: spmd.io.checkpoint on small pytrees (resharding restore, partial and damaged steps),
then the CLI: bitwise resume, resume on another mesh, falling back past a damaged step, SIGTERM
and kill -9 in the middle of a save (real processes), and bad --resume input. The runs that
are not stopped by a signal run in this process (tests/cli.train_in_process).

Every CLI run trains the tiny model under one 400-step schedule and ends early with --stop-after, so
all fsdp=8 runs share one compiled program (cached on disk by JAX for the module's runs)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from spmd.errors import UsageError
from spmd.io import checkpoint, checkpoint_restore
from spmd.parallel import mesh
from spmd.train import main
from tests.cli import train_in_process

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--model", "tiny", "--steps", "400", "--batch", "16", "--seq-len", "32"]
RUN += ["--log-every", "1", "--eval-fraction", "0", "--warmup", "2"]


def sharded_state(
    spec: str, partition: PartitionSpec, value: float = 0.0, devices: int = 8
) -> dict:
    built = mesh.build_mesh(mesh.parse_mesh(spec), jax.devices()[:devices])
    sharding = NamedSharding(built, partition)
    weights = jax.device_put(jnp.arange(64.0).reshape(16, 4) + value, sharding)
    count = jax.device_put(jnp.int32(value), NamedSharding(built, PartitionSpec()))
    return {"params": {"w": weights}, "opt_state": (count, {"m": weights * 2})}


def abstract(state: dict) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def save_steps(directory: Path, steps: list[int]) -> None:
    manager = checkpoint.open_manager(str(directory), keep=5)
    for step in steps:
        state = sharded_state("fsdp=8", PartitionSpec("fsdp"), value=step)
        checkpoint.save(manager, step, state, {"step": step}, {"model": {"embed_dim": 4}})
    manager.close()


@pytest.mark.parametrize(
    "spec, partition, devices",
    [("dp=2,tp=4", PartitionSpec("tensor", "data"), 8), ("dp=2,tp=2", PartitionSpec("data"), 4)],
)
def test_restore_reshards_onto_the_target_layout(tmp_path, spec, partition, devices):
    save_steps(tmp_path, [1, 2])  # saved sharded over fsdp=8
    target = abstract(sharded_state(spec, partition, devices=devices))
    manager = checkpoint.open_manager(str(tmp_path), keep=5)
    restored = checkpoint_restore.restore_newest(manager, target, {"embed_dim": 4}, print)
    manager.close()
    assert restored.step == 2 and restored.data == {"step": 2}
    w = restored.state["params"]["w"]
    assert w.sharding == target["params"]["w"].sharding
    np.testing.assert_array_equal(np.asarray(w), np.arange(64.0).reshape(16, 4) + 2)
    assert (
        isinstance(restored.state["opt_state"], tuple) and int(restored.state["opt_state"][0]) == 2
    )


def test_partial_step_is_set_aside_and_the_previous_one_restored(tmp_path):
    save_steps(tmp_path, [1, 2])
    shutil.rmtree(tmp_path / "2" / "state")  # a step missing its arrays: its manifest says so
    messages = []
    manager = checkpoint.open_manager(str(tmp_path), keep=5)
    restored = checkpoint_restore.restore_newest(
        manager, abstract(sharded_state("fsdp=8", PartitionSpec())), {}, messages.append
    )
    manager.close()
    assert restored.step == 1
    assert messages[0].startswith("checkpoint step 2 is damaged: state/")
    assert "2.damaged" in messages[0]
    assert messages[1].startswith("resuming from step 1")
    assert (tmp_path / "2.damaged" / "data").is_dir() and checkpoint.complete_steps(
        str(tmp_path)
    ) == [1]


def test_no_readable_step_is_a_usage_error(tmp_path):
    save_steps(tmp_path, [1])
    (tmp_path / "1" / "state" / "_METADATA").unlink()
    manager = checkpoint.open_manager(str(tmp_path), keep=5)
    with pytest.raises(UsageError, match="no checkpoint in .* could be read .step 1: "):
        checkpoint_restore.restore_newest(
            manager, abstract(sharded_state("dp=8", PartitionSpec())), {}, print
        )
    manager.close()
    assert (tmp_path / "1.damaged").is_dir()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:6]
    (root / "corpus.txt").write_text("".join(p.read_text() for p in stdlib))
    return root


def cli_args(workdir: Path, *args: str, mesh: str = "fsdp=8") -> list[str]:
    data = ["--data", str(workdir / "corpus.txt"), "--data-cache", str(workdir / "tokens")]
    return [sys.executable, "-m", "spmd.train", *RUN, *data, "--mesh", mesh, *args]


def cli_env(workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(workdir / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def train(workdir: Path, *args: str, mesh: str = "fsdp=8") -> subprocess.CompletedProcess:
    """The command's run in this process: what a resume restores is the same whichever process
    wrote it (the preempted and killed runs above and below are real processes)."""
    return train_in_process(*cli_args(workdir, *args, mesh=mesh)[3:])


def losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def wait_for(predicate, what: str, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def preempted(workdir):
    """An uninterrupted run from step 1, sent SIGTERM once step 6 is logged: its losses are the
    reference every resumed run must reproduce. Returns (checkpoint dir, losses, output)."""
    directory, metrics = workdir / "preempted", workdir / "preempted.jsonl"
    log = workdir / "preempted.log"
    command = cli_args(workdir, "--checkpoint-dir", str(directory), "--checkpoint-every", "0",
                       "--metrics", str(metrics))  # fmt: skip
    with log.open("w") as out:
        run = subprocess.Popen(command, cwd=ROOT, env=cli_env(workdir), stdout=out, stderr=out)
        wait_for(lambda: "  6/400 |" in log.read_text(), "step 6", run)
        run.send_signal(signal.SIGTERM)
        returncode = run.wait(timeout=120)
    assert returncode == 0, log.read_text()[-3000:]
    return directory, losses(metrics), log.read_text()


@pytest.fixture(scope="module")
def reference(preempted):
    return preempted[1]


@pytest.fixture(scope="module")
def stopped_at_3(workdir):
    """A run stopped after step 3 as if preempted, with checkpoints at steps 2 and 3."""
    directory = workdir / "stopped"
    out = ok(train(workdir, "--metrics", str(workdir / "stopped.jsonl"), "--checkpoint-dir",
                   str(directory), "--stop-after", "3", "--checkpoint-every", "2"))  # fmt: skip
    assert "stopped after step 3 (stop_after)" in out
    assert checkpoint.complete_steps(str(directory)) == [2, 3]
    return directory


def copy_of(directory: Path, name: str) -> Path:
    target = directory.with_name(name)
    shutil.copytree(directory, target)
    return target


def test_resume_on_the_same_mesh_is_bitwise(workdir, reference, stopped_at_3):
    directory = copy_of(stopped_at_3, "same-mesh")
    metrics = workdir / "same-mesh.jsonl"
    out = ok(train(workdir, "--metrics", str(metrics), "--checkpoint-dir", str(directory),
                   "--resume", "--stop-after", "6"))  # fmt: skip
    assert "resumed from step 3" in out
    resumed = losses(metrics)
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[step] == reference[step] for step in resumed), (resumed, reference)


def test_resume_on_another_mesh_continues_within_parity(workdir, reference, stopped_at_3):
    # Saved by the auto executor on fsdp=8; resumed by the explicit one on dp=2,tp=4.
    directory = copy_of(stopped_at_3, "other-mesh")
    metrics = workdir / "other-mesh.jsonl"
    out = ok(train(workdir, "--metrics", str(metrics), "--checkpoint-dir", str(directory),
                   "--resume", "--stop-after", "6", "--collectives", "explicit",
                   mesh="dp=2,tp=4"))  # fmt: skip
    assert "saved on mesh fsdp=8, now on mesh dp=2,tp=4" in out
    resumed = losses(metrics)
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss)


def test_damaged_newest_checkpoint_falls_back_to_the_previous(workdir, reference, stopped_at_3):
    directory = copy_of(stopped_at_3, "damaged")
    for chunk in (directory / "3" / "state").rglob("d/*"):  # bit rot in the array data
        chunk.write_bytes(bytes(chunk.stat().st_size))
    metrics = workdir / "damaged.jsonl"
    result = train(workdir, "--metrics", str(metrics), "--checkpoint-dir", str(directory),
                   "--resume", "--stop-after", "4")  # fmt: skip
    out = ok(result) + result.stderr
    assert "checkpoint step 3 is damaged: state/" in out and "fails its crc32 check" in out
    assert "resuming from step 2" in out
    assert (directory / "3.damaged").is_dir()  # kept, not deleted
    resumed = losses(metrics)
    assert resumed == {3: reference[3], 4: reference[4]}
    assert checkpoint.complete_steps(str(directory)) == [2, 4]


def test_checkpoint_of_another_model_shape_is_a_usage_error(workdir, stopped_at_3, capsys):
    directory = copy_of(stopped_at_3, "mismatch")
    argv = cli_args(workdir, "--checkpoint-dir", str(directory), "--resume", "--embed-dim", "32")
    assert main(argv[3:]) == 2
    error = capsys.readouterr().err
    assert "error: the checkpoint at step 3" in error
    assert "holds params/blocks/attn/wk with shape (4, 64, 4, 8)" in error
    assert "this model's params/blocks/attn/wk has shape (4, 32, 4, 8)" in error
    assert "--embed-dim 64" in error
    assert checkpoint.complete_steps(str(directory)) == [2, 3]  # nothing moved or lost


def test_resume_required_without_a_checkpoint_and_fresh_into_a_used_folder(
    workdir, stopped_at_3, capsys
):
    empty = workdir / "empty"
    assert main(cli_args(workdir, "--checkpoint-dir", str(empty), "--resume")[3:]) == 2
    assert "--resume required: --checkpoint-dir" in capsys.readouterr().err
    assert main(cli_args(workdir, "--checkpoint-dir", str(empty), "--resume", "bogus")[3:]) == 2
    assert "--resume 'bogus' is not one of auto, required, fresh" in capsys.readouterr().err
    used = ["--checkpoint-dir", str(stopped_at_3), "--resume", "fresh"]
    assert main(cli_args(workdir, *used)[3:]) == 2
    error = capsys.readouterr().err
    assert (
        "already holds checkpoints (newest: step 3); continue from it with --resume auto" in error
    )
    assert checkpoint.complete_steps(str(stopped_at_3)) == [2, 3]


def test_the_same_command_twice_continues_where_the_first_stopped(workdir, capsys):
    """--resume auto, the default: a command stopped by --stop-after 6 and then run again as it
    was continues from step 6 and ends with the losses of a run that never stopped, which itself
    started fresh in a folder holding only an interrupted save (of the step it saves last)."""

    def command(name: str, *extra: str) -> list[str]:
        folder, metrics = workdir / name, workdir / f"{name}.jsonl"
        args = ("--steps", "8", "--checkpoint-every", "4", "--checkpoint-dir", str(folder))
        return cli_args(workdir, *args, "--metrics", str(metrics), *extra)[3:]

    unbroken = workdir / "unbroken"
    (unbroken / f"8{checkpoint.PARTIAL_SUFFIX}" / "state").mkdir(parents=True)
    assert main(command("unbroken")) == 0
    out = capsys.readouterr().out
    assert f"holds only interrupted saves (8{checkpoint.PARTIAL_SUFFIX}), no complete " in out
    assert "starting fresh" in out and "resumed from" not in out
    assert sorted(os.listdir(unbroken)) == ["4", "8"]  # the partial step 8 was replaced

    assert main(command("twice", "--stop-after", "6")) == 0
    assert "the same command without --stop-after continues from it" in capsys.readouterr().out
    assert main(command("twice")) == 0
    assert "resumed from step 6 in" in capsys.readouterr().out
    expected = losses(workdir / "unbroken.jsonl")
    assert sorted(expected) == list(range(1, 9))
    assert losses(workdir / "twice.jsonl") == expected  # steps 1-6, then 7-8 resumed: bitwise
    assert checkpoint.complete_steps(str(workdir / "twice")) == [4, 6, 8]


def test_sigterm_finishes_the_step_saves_and_exits_0(preempted):
    directory, losses_before, out = preempted
    assert "received SIGTERM" in out and "(SIGTERM); checkpoint saved in" in out
    saved = checkpoint.complete_steps(str(directory))
    assert saved == [max(losses_before)] and saved[0] >= 6
    assert f"stopped after step {saved[0]} (SIGTERM)" in out


def test_kill_9_in_the_middle_of_a_save_then_resume(workdir, preempted):
    """Resume the preempted run saving every step, kill -9 it while a save is being written,
    then resume again: the newest complete checkpoint is used, the partial one is ignored."""
    directory = copy_of(preempted[0], "killed")
    log = (workdir / "killed.log").open("w")
    command = cli_args(workdir, "--checkpoint-dir", str(directory), "--resume",
                       "--checkpoint-every", "1")  # fmt: skip

    def mid_save() -> bool:
        names = os.listdir(directory)
        writing = any(n.endswith(checkpoint.PARTIAL_SUFFIX) for n in names)
        return writing and len(checkpoint.complete_steps(str(directory))) >= 2

    # The save seen in flight may complete in the moment before the kill lands (the kill then
    # falls between two saves): resume and kill again, up to three times.
    for _ in range(3):
        run = subprocess.Popen(command, cwd=ROOT, env=cli_env(workdir), stdout=log, stderr=log)
        wait_for(mid_save, "a save in flight after another completed", run)
        run.kill()
        run.wait(timeout=60)
        partial = [n for n in os.listdir(directory) if n.endswith(checkpoint.PARTIAL_SUFFIX)]
        if partial:
            break
    log.close()
    assert partial, "three kills, each seen during a save, all landed between saves"
    newest = checkpoint.complete_steps(str(directory))[-1]
    assert int(partial[0].split(".")[0]) > newest

    metrics = workdir / "after-kill.jsonl"
    out = ok(train(workdir, "--metrics", str(metrics), "--checkpoint-dir", str(directory),
                   "--resume", "--stop-after", str(newest + 2)))  # fmt: skip
    assert f"resumed from step {newest}" in out
    assert sorted(losses(metrics)) == [newest + 1, newest + 2]
    assert checkpoint.complete_steps(str(directory))[-1] == newest + 2
