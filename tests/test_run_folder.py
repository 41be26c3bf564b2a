"""One folder per run (spmd.training.run_folder): what a default run leaves, its config.toml
running the same training again, the same command continuing a --run-dir, file:// checkpoints
and metrics, data from an fsspec filesystem, log levels and rank files, and the processes of
a job agreeing on one folder."""

import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import fsspec
import pytest

from spmd import checkpoint as checkpoint_command
from spmd import log, report, train
from spmd.io import checkpoint, fetch
from spmd.training import run_folder
from tests.cli import CACHE_HOME, ROOT, records

STEPS = 6
ARGS = ["--model", "tiny", "--mesh", "dp=2", "--batch", "8", "--seq-len", "16"]
ARGS += ["--steps", str(STEPS), "--warmup", "2", "--log-every", "1", "--eval-fraction", "0"]
ARGS += ["--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:3]
    (root / "corpus.txt").write_text("".join(p.read_text() for p in stdlib))
    return root


def data_args(corpus: Path, data: str = "") -> list[str]:
    return ["--data", data or str(corpus / "corpus.txt"), "--data-cache", str(corpus / "tokens")]


def train_losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(metrics) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def default_run(corpus, tmp_path_factory):
    """(the folder of default run folders, the one folder a default run made, its stdout)."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(run_folder.RUNS_ENV, str(root))
        assert train.main([*ARGS, *data_args(corpus)]) == 0
    (folder,) = root.iterdir()
    return root, folder


def test_a_default_run_leaves_one_folder_with_config_metrics_tensorboard_checkpoints(default_run):
    _, folder = default_run
    assert folder.name.startswith("tiny-dp2-")  # <model>-<mesh>-<UTC time>
    names = {"config.toml", "metrics.jsonl", "tensorboard", "checkpoints", "logs"}
    assert {p.name for p in folder.iterdir()} == names  # no --profile: no profile/
    assert sorted(train_losses(folder / "metrics.jsonl")) == list(range(1, STEPS + 1))
    assert checkpoint.complete_steps(str(folder / "checkpoints")) == [2, 4, 6]
    assert list((folder / "tensorboard").glob("events.out.tfevents.*"))
    log = (folder / "logs" / "rank-00000.log").read_text()
    assert f"rank 0 INFO step {STEPS}/{STEPS} | loss" in log


def test_its_config_toml_trains_the_same_losses_into_a_new_folder(default_run, capsys):
    root, folder = default_run
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(run_folder.RUNS_ENV, str(root))
        config = str(folder / "config.toml")
        assert train.main(["--config", config, "--log-level", "warning"]) == 0
    (again,) = set(root.iterdir()) - {folder}
    assert train_losses(again / "metrics.jsonl") == train_losses(folder / "metrics.jsonl")
    assert "step " not in capsys.readouterr().out  # --log-level warning: no progress lines
    assert "INFO" not in (again / "logs" / "rank-00000.log").read_text()
    assert log.LOGGER.level == logging.INFO  # the level of one run does not outlive it


def test_the_same_command_twice_into_a_run_dir_continues_with_file_url_checkpoints(
    default_run, corpus, tmp_path, capsys
):
    """--stop-after 3, then the same command: it resumes at step 3 from file:// checkpoints,
    appends to the file:// metrics and ends with the losses of the uninterrupted default run."""
    _, uninterrupted = default_run
    with fsspec.open("memory://spmd-test/corpus.txt", "wb") as f:  # a bucket's stand-in
        f.write((corpus / "corpus.txt").read_bytes())
    args = [*ARGS, *data_args(corpus, "memory://spmd-test/corpus.txt")]
    args += ["--run-dir", str(tmp_path / "run"), "--checkpoint-dir", f"file://{tmp_path}/ck"]
    args += ["--metrics", f"file://{tmp_path}/m.jsonl"]
    assert train.main([*args, "--stop-after", "3"]) == 0
    assert train.main(args) == 0
    assert "resumed from step 3 in file://" in capsys.readouterr().out
    metrics = tmp_path / "m.jsonl"
    assert train_losses(metrics) == train_losses(uninterrupted / "metrics.jsonl")
    assert [r["step"] for r in records(metrics) if r["kind"] == "resume"] == [3]
    assert not (tmp_path / "run" / "checkpoints").exists()  # the path flags win
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"config.toml", "logs", "tensorboard"}
    assert checkpoint.complete_steps(f"file://{tmp_path}/ck") == [3, 4, 6]
    capsys.readouterr()
    assert checkpoint_command.main(["verify", f"file://{tmp_path}/ck"]) == 0
    verdicts = capsys.readouterr().out.splitlines()
    assert len(verdicts) == 3 and all(": ok: " in line for line in verdicts)  # manifests written


def test_report_reads_a_run_folder_and_draws_into_it(default_run):
    _, folder = default_run
    assert report.main([str(folder)]) == 0
    assert (folder / "report.png").stat().st_size > 0


def test_dry_run_and_run_dir_none_make_no_folder(tmp_path):
    root = tmp_path / "runs"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(run_folder.RUNS_ENV, str(root))
        assert train.main([*ARGS, "--dry-run"]) == 0
        for flags in (["--dry-run"], ["--run-dir", "none"]):
            cfg = train.Config.of(train.resolve_sections([*ARGS, *flags]))
            assert run_folder.planned_folder(cfg) is None
    assert not root.exists()


def test_a_run_refused_after_its_folder_opened_says_why_in_its_log(corpus, tmp_path, capsys):
    """The mesh is checked against the model after the folder opened: the exit-2 line goes to
    stderr as always and ends the rank file, so the folder says why nothing trained."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(run_folder.RUNS_ENV, str(tmp_path))
        # 3 kv heads do not split 2 ways (2 devices: as many as ARGS's dp=2 takes)
        bad_mesh = [*ARGS, "--mesh", "tp=2", "--n-heads", "3", "--n-kv-heads", "3"]
        assert train.main([*bad_mesh, *data_args(corpus)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and "kv_heads" in error
    (folder,) = tmp_path.iterdir()
    last = (folder / "logs" / "rank-00000.log").read_text().splitlines()[-1]
    assert last.endswith(f"ERROR {error}")


def test_without_the_variable_run_folders_go_under_runs_and_none_turns_them_off(monkeypatch):
    cfg = train.Config.of(train.resolve_sections(["--model", "tiny", "--mesh", "fsdp=2"]))
    monkeypatch.delenv(run_folder.RUNS_ENV)
    assert run_folder.planned_folder(cfg, "t") == "runs/tiny-fsdp2-t"
    monkeypatch.setenv(run_folder.RUNS_ENV, "none")
    assert run_folder.planned_folder(cfg, "t") is None
    given = train.Config.of(train.resolve_sections(["--model", "tiny", "--run-dir", "r"]))
    assert run_folder.planned_folder(given) == "r"


def test_run_names_say_model_mesh_and_stamp(monkeypatch):
    cfg = train.Config.of(train.resolve_sections(["--model", "tiny", "--mesh", "dp=2,fsdp=2,tp=2"]))
    monkeypatch.setenv(run_folder.RUNS_ENV, "/r")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a requeued SLURM job keeps its id: same folder
    assert run_folder.choose_folder(cfg) == "/r/tiny-dp2-fsdp2-tp2-job4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert run_folder.mesh_label("dp=-1,tp=2") == "dp-tp2"
    named = train.Config.of(train.resolve_sections(["--model", "tiny", "--run-name", "a"]))
    assert run_folder.choose_folder(named) == "/r/a"


def test_a_data_folder_url_is_copied_once_into_the_cache(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe(
        {"/spmd-fetch/shards/a.jsonl": b'{"text": "a"}\n', "/spmd-fetch/shards/b/c.jsonl": b"{}"}
    )
    local = Path(fetch.local_copy("memory://spmd-fetch/shards", tmp_path))
    assert (local / "a.jsonl").read_bytes() == b'{"text": "a"}\n'
    assert (local / "b" / "c.jsonl").read_bytes() == b"{}"
    assert fetch.local_copy(f"file://{local}/a.jsonl", tmp_path) == f"{local}/a.jsonl"


def test_two_processes_agree_on_one_run_folder_and_each_writes_its_log(corpus, tmp_path):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "XDG_CACHE_HOME": CACHE_HOME,
        run_folder.RUNS_ENV: str(tmp_path / "runs"),
    }
    env.pop("SLURM_JOB_ID", None)
    command = [sys.executable, "-m", "spmd.launch", "-n", "2", "--devices-per-process", "1"]
    command += ["--", sys.executable, "-m", "spmd.train", *ARGS, *data_args(corpus)]
    command += ["--steps", "2"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (folder,) = (tmp_path / "runs").iterdir()
    for rank in (0, 1):
        assert (
            f"rank {rank} INFO step 2/2" in (folder / "logs" / f"rank-0000{rank}.log").read_text()
        )
    assert sorted(train_losses(folder / "metrics.jsonl")) == [1, 2]  # written once, by rank 0


def test_checkpoint_dir_none_keeps_the_folder_but_saves_no_checkpoints():
    given = ["--model", "tiny", "--run-dir", "r", "--checkpoint-dir", "none"]
    cfg = train.Config.of(train.resolve_sections(given))
    placed = run_folder.with_paths(cfg, "r")
    assert placed.checkpoint.checkpoint_dir == "" and placed.observe.metrics == "r/metrics.jsonl"
    without = train.Config.of(train.resolve_sections([*given[:2], "--checkpoint-dir", "none"]))
    assert run_folder.with_paths(without, None).checkpoint.checkpoint_dir == ""


def test_a_run_folder_resumes_from_another_folder_and_after_a_move(corpus, tmp_path, monkeypatch):
    """The metrics record names the checkpoints as the run was given them (relative to the
    folder it started in): resumed from another folder, or moved whole, the run folder is still
    its own run's, and another run's --metrics into it is still refused."""
    args = [*ARGS, *data_args(corpus), "--steps", "4", "--tracker", "none"]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    assert train.main([*args, "--run-dir", "runs/a", "--stop-after", "2"]) == 0
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert train.main([*args, "--run-dir", "../runs/a", "--stop-after", "3"]) == 0
    (tmp_path / "runs" / "a").rename(tmp_path / "moved")
    assert train.main([*args, "--run-dir", "../moved"]) == 0
    assert checkpoint.complete_steps(str(tmp_path / "moved" / "checkpoints"))[-1] == 4
    other = [*args, "--checkpoint-dir", "other", "--metrics", "../moved/metrics.jsonl"]
    assert train.main(other) == 2
