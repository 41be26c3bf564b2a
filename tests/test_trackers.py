"""Experiment trackers (spmd.observe.trackers): a run with --tracker tensorboard,wandb,mlflow
leaves the JSONL's scalars, its config and its summary in W&B's offline run file and in an
MLflow file store, read back here with their own readers (W&B's record protobufs, MLflow's
client); a tracker that cannot start is one warning line, one that fails mid-run is dropped
with one line while the JSONL goes on."""

import json
import shutil
import struct
import sysconfig
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from wandb.proto import wandb_internal_pb2

from spmd import train
from spmd.observe import trackers
from spmd.observe.metrics import MetricsLog
from tests.cli import records

STEPS = 4
BLOCK, HEADER = 32768, 7  # the .wandb file: a 7-byte header, then LevelDB-log blocks


def wandb_records(path: Path) -> list:
    """The Record protobufs of a W&B run file (the LevelDB log format W&B writes: records of
    checksum, length, type in blocks of 32 KiB; types FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, found, pending = HEADER, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4) and pending:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def items(entries) -> dict:
    return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A 4-step run with all three trackers, W&B offline, MLflow into the run folder."""
    root = tmp_path_factory.mktemp("tracked")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:3]
    (root / "corpus.txt").write_text("".join(p.read_text() for p in stdlib))
    args = ["--model", "tiny", "--mesh", "dp=2", "--batch", "8", "--seq-len", "16"]
    args += ["--steps", str(STEPS), "--log-every", "1", "--eval-fraction", "0"]
    args += ["--data", str(root / "corpus.txt"), "--data-cache", str(root / "tokens")]
    args += ["--run-dir", str(root / "run"), "--tracker", "tensorboard,wandb,mlflow"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        assert train.main(args) == 0
    folder = root / "run"
    return folder, records(folder / "metrics.jsonl")


def test_wandb_offline_run_holds_the_scalars_config_and_summary(tracked_run):
    folder, lines = tracked_run
    (run_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    found = wandb_records(run_file)
    history = [items(r.history.item) for r in found if r.WhichOneof("record_type") == "history"]
    losses = {h["_step"]: h["train/loss"] for h in history if "train/loss" in h}
    train_records = [r for r in lines if r["kind"] == "train"]
    assert losses == pytest.approx({r["step"]: r["loss"] for r in train_records}, rel=1e-6)
    config = {}
    for r in found:
        if r.WhichOneof("record_type") == "config":
            config.update(items(r.config.update))
    assert config["run.steps"] == STEPS and config["parallel.mesh"] == "dp=2"
    summary = {}
    for r in found:
        if r.WhichOneof("record_type") == "summary":
            summary.update(items(r.summary.update))
    assert summary["config/n_params"] == lines[0]["n_params"]  # the config record's figures
    final = next(r for r in lines if r["kind"] == "summary")
    assert summary["summary/final_loss"] == pytest.approx(final["final_loss"], rel=1e-6)


def test_mlflow_file_store_holds_the_scalars_and_params(tracked_run):
    folder, lines = tracked_run
    client = MlflowClient(tracking_uri=f"file://{folder / 'mlruns'}")
    experiment = client.get_experiment_by_name(trackers.PROJECT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == folder.name and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    train_records = [r for r in lines if r["kind"] == "train"]
    assert {m.step: m.value for m in history} == pytest.approx(
        {r["step"]: r["loss"] for r in train_records}, rel=1e-6
    )
    assert run.data.params["run.steps"] == str(STEPS)
    assert run.data.metrics["config/n_params"] == lines[0]["n_params"]
    tflops = client.get_metric_history(run.info.run_id, "train/tflops_per_device")
    assert [m.step for m in tflops] == list(range(1, STEPS + 1))


def test_trackers_that_cannot_start_are_one_warning_each(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "online")  # no key, no netrc: W&B would ask for a login
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    assert trackers.open_trackers(["wandb", "mlflow"], "", str(tmp_path), "x") == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("warning: tracker wandb did not start (RuntimeError: no W&B login")
    assert lines[1].startswith("warning: tracker mlflow did not start")


def test_a_tracker_failing_mid_run_is_dropped_in_one_line_and_the_jsonl_goes_on(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tracker,) = trackers.open_trackers(["mlflow"], "", str(tmp_path), "failing")
    log = MetricsLog(str(tmp_path / "m.jsonl"), trackers=[tracker])
    log.write("train", step=1, loss=2.0)
    shutil.rmtree(tmp_path / "mlruns")  # the store goes away under the run
    log.write("train", step=2, loss=1.5)
    log.write("train", step=3, loss=1.0)
    log.close()
    assert [r["step"] for r in records(tmp_path / "m.jsonl")] == [1, 2, 3]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("warning: tracker mlflow failed (") and "going on without it" in line


def test_an_unknown_tracker_exits_2_naming_the_choices(capsys):
    assert train.main(["--model", "tiny", "--tracker", "tensorboard,neptune", "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "error: --tracker 'neptune' is not one of tensorboard, wandb, mlflow (comma-separated), "
        "or none"
    )
