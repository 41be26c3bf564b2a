"""Nothing a user wrote or trained is lost: a lock on each folder a run writes (a second run
exits 2 naming the first; a stale lock is taken over), folders and metrics files holding what
spmd did not write are refused, rotation deletes only spmd's own steps, a run whose every step
is damaged is not silently restarted, and unverified or implausible steps are not trained on.
Real orbax checkpoints of the tiny model throughout (2-4 steps, --checkpoint-every 1); the
concurrent-runs test starts real processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from spmd import train
from spmd.errors import UsageError
from spmd.io import checkpoint, manifest, params_io, state_check
from spmd.training import folder_lock
from spmd.training.folder_lock import LOCK_FILE, FolderLocks, Holder
from tests.cli import CACHE_HOME, ROOT, records
from tests.test_checkpoint import save_steps, sharded_state

RUN = ["--model", "tiny", "--mesh", "dp=1", "--batch", "4", "--seq-len", "16", "--warmup", "1"]
RUN += ["--checkpoint-every", "1", "--log-every", "1", "--eval-fraction", "0"]
RUN += ["--tracker", "none"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("safety-data")
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 2000)
    return ["--data", str(root / "corpus.txt"), "--data-cache", str(root / "tokens")]


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def flip(path: Path, count: int) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def largest_data_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("d/*")), key=lambda p: p.stat().st_size)


def test_two_runs_into_one_folder_started_together_the_second_exits_2(data, tmp_path):
    """Started in the same instant with different seeds: one gets the lock, the other exits 2
    within 60 s naming it; the folder then holds valid JSONL and only the winner's steps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": CACHE_HOME}
    folder = tmp_path / "R"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "spmd.train", *RUN, *data, "--steps", "3"]
            + ["--run-dir", str(folder), "--seed", str(seed)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for seed in (0, 1)
    ]
    started = time.monotonic()
    outcomes = {}
    for seed, proc in enumerate(procs):
        out, err = proc.communicate(timeout=120)
        outcomes[seed] = (proc.returncode, time.monotonic() - started, err)
    (winner,) = [s for s, (code, _, _) in outcomes.items() if code == 0]
    code, seconds, err = outcomes[1 - winner]
    assert code == 2 and seconds < 60, outcomes
    assert err.count("\n") == 1 and "is in use by another run: pid " in err, err
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines].count("config") == 1  # all valid JSON
    assert checkpoint.complete_steps(str(folder / "checkpoints")) == [1, 2, 3]
    saved = params_io.saved_config(str(folder / "checkpoints"), 3)
    assert saved["run"]["seed"] == winner
    assert not (folder / LOCK_FILE).exists() and not (folder / "checkpoints" / LOCK_FILE).exists()


def write_lock(folder: Path, host: str, pid: int, heartbeat: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(Holder(host, pid, heartbeat, heartbeat).text())


def test_a_live_lock_is_refused_and_a_stale_one_taken_over_in_one_line(tmp_path):
    here, now = socket.gethostname(), time.time()
    write_lock(tmp_path / "live", "node-9", 4242, now)
    with pytest.raises(UsageError, match=r"in use by another run: pid 4242 on node-9 \(started"):
        FolderLocks([str(tmp_path / "live")]).acquire()
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_lock(tmp_path / "dead", here, dead.pid, now)  # this host, its process gone
    write_lock(tmp_path / "silent", "node-9", 4242, now - folder_lock.STALE_S - 5)
    told = []
    locks = FolderLocks([str(tmp_path / "dead"), str(tmp_path / "silent")])
    locks.acquire(told.append)
    assert len(told) == 2
    assert told[0].startswith(f"took over the lock of {tmp_path / 'dead'} from pid {dead.pid}")
    assert told[0].endswith("its process is no longer running")
    assert "no heartbeat for 605 s" in told[1]
    holder = folder_lock.read_holder(tmp_path / "dead" / LOCK_FILE)
    assert (holder.host, holder.pid) == (here, os.getpid())
    locks.release()
    assert not list((tmp_path / "dead").iterdir()) and not list((tmp_path / "silent").iterdir())


def test_a_run_refused_after_taking_its_locks_releases_them(tmp_path, capsys):
    """--resume required into an empty folder exits 2 after the locks were taken: gone."""
    argv = [*RUN, "--steps", "2", "--run-dir", str(tmp_path / "R"), "--resume", "required"]
    assert train.main(argv) == 2
    assert "holds no complete checkpoint" in error_line(capsys)
    assert not list(tmp_path.rglob(f"{LOCK_FILE}*"))


def test_a_bucket_folder_is_not_locked_and_the_run_says_so(tmp_path, monkeypatch):
    """A gs:// checkpoint folder beside a local run folder: the local one is locked, the bucket
    is not (no exclusive create to lock it with), and one warning line says so."""
    from spmd.run.config import flat
    from spmd.training import claims

    told: list[str] = []
    monkeypatch.setattr(claims, "warn", told.append)
    monkeypatch.setattr(claims, "check_unlocked", lambda cfg, folder: None)  # no bucket here
    cfg = flat(checkpoint_dir="gs://bucket/ck")
    locks = claims.claim(cfg, str(tmp_path / "R"))
    try:
        assert locks.paths == [tmp_path / "R" / LOCK_FILE]
        assert told == [
            "gs://bucket/ck is not locked (a bucket has no exclusive create spmd can use): a "
            "second run writing it at the same time would not be refused; start one at a time"
        ]
    finally:
        claims.release()


def test_rotation_deletes_only_steps_spmd_wrote(tmp_path):
    """A folder named like a step without orbax's metadata and a manifest (the user's) is kept
    when rotation passes it; spmd's own older steps go."""
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "notes.txt").write_text("mine")
    save_steps(tmp_path, [1, 3, 4, 5, 6, 7])  # keeps 5: 1 is deleted, 2 would be next
    assert (tmp_path / "2" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "1").exists()
    assert checkpoint.complete_steps(str(tmp_path)) == [2, 3, 4, 5, 6, 7]


def test_unverified_steps_are_set_aside_or_refused_unless_allowed(data, tmp_path, capsys):
    """Step 3 without a manifest (a kill before it was written) is set aside for the verified
    step 2; a folder of only unverified steps exits 2 until --allow-unverified."""
    ck = tmp_path / "ck"
    args = [*RUN, *data, "--checkpoint-dir", str(ck), "--metrics", str(tmp_path / "m.jsonl")]
    assert train.main([*args, "--steps", "3"]) == 0
    (ck / "3" / manifest.MANIFEST).unlink()
    capsys.readouterr()
    assert train.main([*args, "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint step 3 has no manifest.json (an older spmd's step, or stopped before " \
           f"writing it): set it aside to {ck}/3.unverified, trying the older verified step 2" \
           in out  # fmt: skip
    assert "resumed from step 2" in out
    assert (ck / "3.unverified").is_dir() and checkpoint.complete_steps(str(ck)) == [1, 2, 3]
    for step_manifest in ck.glob(f"[0-9]/{manifest.MANIFEST}"):  # as an older spmd saved
        step_manifest.unlink()
    assert train.main([*args, "--steps", "4"]) == 2
    assert "no step has a manifest.json" in error_line(capsys)
    assert train.main([*args, "--steps", "4", "--allow-unverified"]) == 0
    assert "checkpoint step 3 has no manifest.json" in capsys.readouterr().out


def test_flipped_bytes_of_an_unverified_step_are_never_trained_on(data, tmp_path, capsys):
    """16 flipped bytes in a step without a manifest, read with --allow-unverified: the restored
    state fails its saved norms, the step goes to <step>.damaged and the run continues from
    the step before, so no manifest ever certifies the damage."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = [*RUN, *data, "--checkpoint-dir", str(ck), "--metrics", str(metrics)]
    assert train.main([*args, "--steps", "3"]) == 0
    flip(largest_data_file(ck / "3"), 16)
    (ck / "3" / manifest.MANIFEST).unlink()
    capsys.readouterr()
    assert train.main([*args, "--steps", "4", "--allow-unverified"]) == 0
    out = capsys.readouterr().out
    told = next(
        line for line in out.splitlines() if line.startswith("checkpoint step 3 is damaged")
    )
    assert ": restored, its " in told and f"moved it to {ck}/3.damaged" in told
    assert "resumed from step 2" in out
    assert manifest.verify(ck / "4").status == "ok"
    assert checkpoint.complete_steps(str(ck)) == [2, 3, 4]  # 3 trained again from 2
    losses = [r["loss"] for r in records(metrics) if r["kind"] == "train"]
    assert all(abs(loss) < 10 for loss in losses)


def test_implausible_states_are_named():
    state = sharded_state("fsdp=8", PartitionSpec("fsdp"), value=1.0)
    norms = state_check.state_norms(state)
    assert state_check.implausible(state, norms) is None
    assert state_check.implausible(state, None) is None  # no norms saved: the scale is plausible
    scaled = {**state, "params": {"w": state["params"]["w"] * 1e5}}
    assert "root-mean-square" in state_check.implausible(scaled, None)
    assert "have norm" in state_check.implausible(scaled, norms)
    broken = {**state, "params": {"w": state["params"]["w"].at[0, 0].set(jnp.inf)}}
    assert "not finite" in state_check.implausible(broken, norms)


def test_a_run_whose_every_step_is_damaged_is_not_restarted_silently(data, tmp_path, capsys):
    """Every step damaged: exit 2 (setting them aside), and again on the retry; --resume never
    (fresh) starts at step 1 and appends to the metrics, keeping their history."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = [*RUN, *data, "--checkpoint-dir", str(ck), "--metrics", str(metrics), "--steps", "2"]
    assert train.main(args) == 0
    for step in (1, 2):
        flip(largest_data_file(ck / str(step)), 4096)
    capsys.readouterr()
    assert train.main([*args, "--steps", "3"]) == 2  # sets both aside
    assert "no checkpoint in" in error_line(capsys)
    assert train.main([*args, "--steps", "3"]) == 2  # the retry: still no silent step 1
    assert "every step was set aside as damaged (1.damaged, 2.damaged)" in error_line(capsys)
    assert train.main([*args, "--resume", "never"]) == 0
    kinds = [(r["kind"], r.get("step")) for r in records(metrics)]
    assert kinds.count(("config", None)) == 2 and kinds.count(("train", 1)) == 2  # both kept
    assert checkpoint.complete_steps(str(ck)) == [1, 2]


def test_the_run_folder_of_a_user_is_never_written(data, tmp_path, capsys):
    """A folder holding someone's config.toml and metrics.jsonl, --metrics of a notes file and
    a checkpoint folder of files 1..5: each exits 2 naming them, their bytes unchanged."""
    folder = tmp_path / "R"
    folder.mkdir()
    (folder / "config.toml").write_text("[mine]\nx = 1\n")
    (folder / "metrics.jsonl").write_text("my own notes\n")
    (tmp_path / "notes.txt").write_text("notes\n")
    ck = tmp_path / "D"
    ck.mkdir()
    for i in range(1, 6):
        (ck / str(i)).write_text(f"file {i}\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [
        (["--run-dir", str(folder)], "config.toml (not one spmd wrote)"),
        (["--metrics", str(tmp_path / "notes.txt")], "is not an spmd metrics file"),
        (["--checkpoint-dir", str(ck)], "did not write (1, 2, 3, 4, 5)"),
    ]
    for flags, named in cases:
        assert train.main([*RUN, *data, "--steps", "2", *flags]) == 2
        assert named in error_line(capsys)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert {p.name for p in folder.iterdir()} == {"config.toml", "metrics.jsonl"}  # nothing made
