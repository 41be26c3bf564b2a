"""Checkpoints you can trust: every saved step carries a manifest of its files' sizes and
checksums, which names the file that changed, and `spmd.checkpoint verify` checks a folder's
steps against theirs. Real checkpoints on disk throughout: orbax's, then damaged by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmd import checkpoint as checkpoint_command
from spmd.io import manifest
from tests.test_checkpoint import save_steps


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
