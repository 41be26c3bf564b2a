"""Checkpoints you can trust: every saved step carries a manifest of its files' sizes and
checksums, which names the file that changed. Real checkpoints on disk throughout: orbax's,
then damaged by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
