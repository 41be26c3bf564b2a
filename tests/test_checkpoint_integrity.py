"""Checkpoints you can trust: every saved step carries a manifest of its files' sizes and
checksums; a step that fails it is named in one line, by `spmd.checkpoint verify`, by a resumed
run (which sets it aside and goes on from the newest good step) and by the read-only commands
(which refuse it); a step without one is read unverified. Real checkpoints on disk throughout:
orbax's, then damaged by hand."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from jax.sharding import PartitionSpec

from spmd import checkpoint as checkpoint_command
from spmd import generate
from spmd.io import checkpoint, checkpoint_restore, manifest, stray_reads
from tests import cli
from tests.test_checkpoint import abstract, save_steps, sharded_state

TRAIN = ["--model", "tiny", "--steps", "400", "--batch", "16", "--seq-len", "32"]
TRAIN += ["--log-every", "1", "--eval-fraction", "0", "--warmup", "2", "--mesh", "fsdp=8"]


# The training runs here share their compiled steps (the same program each time).
JAX_CACHE = tempfile.mkdtemp(prefix="spmd-test-integrity-jax-")


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args` as a user runs it (tests.cli.run's environment)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(cli.ROOT)}
    env |= {"XDG_CACHE_HOME": cli.CACHE_HOME, "JAX_COMPILATION_CACHE_DIR": JAX_CACHE}
    env |= {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    # XLA_FLAGS (the fast-compile flags of conftest) carry over: these programs are tiny too
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cli.ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def largest_data_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("d/*") if p.is_file()), key=file_size)


def file_size(path: Path) -> int:
    return path.stat().st_size


def flip(path: Path, count: int = 4096) -> None:
    """Invert `count` bytes in the middle of a file, keeping its size: bit rot."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def relative(path: Path, step_dir: Path) -> str:
    return path.relative_to(step_dir).as_posix()


def test_every_saved_step_gets_a_manifest_of_all_its_files(tmp_path):
    save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        step_dir = tmp_path / str(step)
        listed = json.loads((step_dir / manifest.MANIFEST).read_text())
        assert listed["algorithm"] == "crc32"
        assert sorted(listed["files"]) == manifest.step_files(step_dir)
        # written after orbax's commit: the files of the commit itself are listed
        assert {"_CHECKPOINT_METADATA", "commit_success.txt"} <= set(listed["files"])
        assert manifest.verify(step_dir).status == "ok"


@pytest.mark.parametrize(
    "damage, named, why",
    [
        (flip, "data", "fails its crc32 check"),
        (truncate, "data", "bytes where"),
        (Path.unlink, "data", "is missing"),
        (lambda p: p.write_text("{not json"), manifest.MANIFEST, "cannot be read as a manifest"),
    ],
)
def test_verify_names_the_file_that_changed(tmp_path, damage, named, why):
    save_steps(tmp_path, [1])
    step_dir = tmp_path / "1"
    target = largest_data_file(step_dir) if named == "data" else step_dir / named
    damage(target)
    verdict = manifest.verify(step_dir)
    assert verdict.status == "damaged" and why in verdict.why
    assert verdict.file == relative(target, step_dir)


# orbax's stray reads after a failed one would print tracebacks (see quiet_stray_reads)
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_step_without_a_manifest_is_read_unverified_and_its_damage_told_in_one_line(tmp_path):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "2" / manifest.MANIFEST).unlink()  # as saved by an older spmd
    truncate(largest_data_file(tmp_path / "2"))
    messages = []
    manager = checkpoint.open_manager(str(tmp_path), keep=5)
    restored = checkpoint_restore.restore_newest(
        manager, abstract(sharded_state("fsdp=8", PartitionSpec())), {}, messages.append, True
    )  # allow_unverified: without it step 2 is set aside unread (tests/test_data_safety.py)
    manager.close()
    time.sleep(0.3)  # the other reads finish here, in the test, whose stray errors fail it
    gc.collect()
    assert restored.step == 1
    assert messages[0].startswith("checkpoint step 2 has no manifest.json")
    assert messages[0].endswith("reading it unverified")
    assert messages[1].startswith("checkpoint step 2 is damaged: ")
    assert "\n" not in messages[1] and len(messages[1]) < 500, messages[1]
    assert (tmp_path / "2.damaged").is_dir()


def test_only_the_stray_reads_of_a_failed_restore_are_kept_off_the_terminal(monkeypatch):
    reached = []
    monkeypatch.setattr(sys, "unraisablehook", reached.append)
    stray_reads.quiet_stray_reads()
    stray_reads.quiet_stray_reads()  # once is enough: no hook wraps another of its kind
    stray = SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None)
    other = SimpleNamespace(exc_value=RuntimeError("something else"), object=None)
    sys.unraisablehook(stray)
    sys.unraisablehook(other)
    assert reached == [other]


def test_the_verify_command_lists_each_step_and_exits_2_on_damage(tmp_path, capsys):
    save_steps(tmp_path, [1, 2, 3])
    (tmp_path / "1" / manifest.MANIFEST).unlink()
    assert checkpoint_command.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{tmp_path}/1: unverified: no manifest.json (an older spmd's step, or " \
                     f"stopped before writing it)"  # fmt: skip
    assert out[1].startswith(f"{tmp_path}/2: ok: ") and out[2].startswith(f"{tmp_path}/3: ok: ")

    damaged = largest_data_file(tmp_path / "2")
    flip(damaged)
    assert checkpoint_command.main(["verify", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    name = relative(damaged, tmp_path / "2")
    assert f"{tmp_path}/2: damaged: {name} fails its crc32 check" in captured.out
    assert captured.err.count("\n") == 1 and f"1 damaged step(s): {tmp_path}/2" in captured.err
    assert checkpoint_command.main(["verify", str(tmp_path), "--step", "3"]) == 0
    assert (tmp_path / "2").is_dir()  # verify moves nothing


@pytest.mark.parametrize(
    "argv, error",
    [
        (["check", "x"], "'check' is not an action of spmd.checkpoint"),
        (["verify"], "verify needs a checkpoint folder"),
        (["verify", "/nonexistent"], "/nonexistent is not a folder"),
        (["verify", "{tmp}", "--step", "9"], "--step 9 is not in"),
    ],
)
def test_the_verify_command_refuses_bad_input_in_one_line(tmp_path, capsys, argv, error):
    save_steps(tmp_path, [1])
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert checkpoint_command.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and error in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run of the tiny model stopped after step 3, with checkpoints at steps 2 and 3:
    (its checkpoint folder, its losses by step, the data flags that resume it)."""
    root = tmp_path_factory.mktemp("integrity")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:6]
    (root / "corpus.txt").write_text("".join(p.read_text() for p in stdlib))
    data = ["--data", str(root / "corpus.txt"), "--data-cache", str(root / "tokens")]
    directory, metrics = root / "ckpt", root / "run.jsonl"
    saving = ["--checkpoint-dir", str(directory), "--checkpoint-every", "2"]
    result = cli.train_in_process(
        *TRAIN, *data, *saving, "--stop-after", "3", "--metrics", str(metrics)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint.complete_steps(str(directory)) == [2, 3]
    return directory, train_losses(metrics), data


def train_losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def damaged_copy(trained, tmp_path: Path, damage) -> tuple[Path, str]:
    """A copy of the run's checkpoints with `damage` done to step 3's largest data file:
    (the folder, that file relative to the step)."""
    directory = tmp_path / "ckpt"
    shutil.copytree(trained[0], directory)
    target = largest_data_file(directory / "3")
    damage(target)
    return directory, relative(target, directory / "3")


def short_and_clean(stderr: str, lines: int = 20) -> None:
    assert "Traceback" not in stderr and len(stderr.splitlines()) < lines, stderr[-3000:]


def test_flipped_bytes_verify_exits_2_naming_the_file(trained, tmp_path):
    directory, name = damaged_copy(trained, tmp_path, flip)
    result = run("spmd.checkpoint", "verify", str(directory))
    assert result.returncode == 2
    assert f"{directory}/2: ok" in result.stdout
    assert f"{directory}/3: damaged: {name} fails its crc32 check" in result.stdout
    assert result.stderr.startswith("error: 1 damaged step(s)") and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "command, args",
    [("spmd.generate", ["--prompt", "def ", "--max-new-tokens", "4"]), ("spmd.convert", [])],
)
def test_flipped_bytes_generate_and_convert_exit_2_in_one_line(trained, tmp_path, command, args):
    directory, name = damaged_copy(trained, tmp_path, flip)
    if command == "spmd.convert":
        args = ["--to-hf", str(tmp_path / "hf")]
    result = run(command, "--checkpoint", str(directory), *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {directory} step 3 is damaged: {name} fails")
    assert (directory / "3").is_dir() and not (tmp_path / "hf").exists()  # nothing moved


def test_flipped_bytes_resume_sets_the_step_aside_and_goes_on_from_the_previous(trained, tmp_path):
    directory, name = damaged_copy(trained, tmp_path, flip)
    metrics = tmp_path / "resumed.jsonl"
    resume = ("--checkpoint-dir", str(directory), "--resume", "--stop-after", "4")
    result = cli.train_in_process(*TRAIN, *trained[2], *resume, "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    short_and_clean(result.stderr)
    assert f"checkpoint step 3 is damaged: {name} fails its crc32 check" in result.stdout
    assert "resumed from step 2" in result.stdout
    assert (directory / "3.damaged").is_dir()  # kept, not deleted
    assert checkpoint.complete_steps(str(directory)) == [2, 4]
    resumed = train_losses(metrics)
    assert sorted(resumed) == [3, 4] and resumed[3] == trained[1][3]  # bitwise: same mesh


def test_truncated_file_is_named_by_verify_and_refused_by_generate(trained, tmp_path, capsys):
    directory, name = damaged_copy(trained, tmp_path, truncate)
    assert checkpoint_command.main(["verify", str(directory)]) == 2
    assert f"3: damaged: {name} holds " in capsys.readouterr().out
    assert generate.main(["--checkpoint", str(directory), "--prompt", "x", "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"step 3 is damaged: {name} holds " in err


def test_truncated_file_of_a_step_without_manifest_falls_back_quietly(trained, tmp_path):
    """Steps of an spmd older than manifests, read with --allow-unverified (without it the run
    exits 2: tests/test_data_safety.py)."""
    directory, _ = damaged_copy(trained, tmp_path, truncate)
    for step_manifest in directory.glob(f"*/{manifest.MANIFEST}"):  # as an older spmd saved
        step_manifest.unlink()
    resume = ("--checkpoint-dir", str(directory), "--resume", "--stop-after", "3")
    result = cli.train_in_process(*TRAIN, *trained[2], *resume, "--allow-unverified")
    assert result.returncode == 0, result.stderr[-3000:]
    short_and_clean(result.stderr)
    told = [line for line in result.stdout.splitlines() if "checkpoint step 3" in line]
    assert told[0].endswith("reading it unverified")
    assert told[1].startswith("checkpoint step 3 is damaged: ") and len(told[1]) < 500
    assert "resumed from step 2" in result.stdout and (directory / "3.damaged").is_dir()
