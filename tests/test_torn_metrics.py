"""A metrics file whose last line was cut short (a write that failed on a full disk, a kill):
a resumed run sets the torn bytes aside before it appends, and spmd.report reads such a file
while it is still being written, but still refuses a broken line in the middle. Real files,
written by MetricsLog as a run writes them."""

import json

import pytest

from spmd import report
from spmd.errors import UsageError
from spmd.observe.metrics import TORN_SUFFIX, MetricsLog
from spmd.training import claims

CONFIG = {"config": {"run": {"model": "tiny"}}, "mesh": {"data": 2}, "mesh_text": "dp=2"}


def write_run(path, steps) -> None:
    """A metrics file as a run leaves it: a config record, then a train record per step."""
    log = MetricsLog(str(path), append=path.exists())
    log.write("config", **CONFIG)
    for step in steps:
        log.write("train", step=step, loss=5.0 - step / 10, grad_norm=1.0, lr=1e-3)
    log.close()


def tear(path) -> bytes:
    """Cut the file's last record in half, as a write that failed halfway leaves it."""
    whole = path.read_bytes()
    last = whole.rstrip(b"\n").rfind(b"\n") + 1
    torn = whole[last : last + (len(whole) - last) // 2]
    path.write_bytes(whole[:last] + torn)
    return torn


def test_a_resumed_run_sets_a_torn_last_line_aside_before_appending(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    write_run(metrics, [1, 2, 3])
    torn = tear(metrics)
    write_run(metrics, [3, 4])  # the resumed run: its config record first
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["config", "train", "train"] + [
        "config", "train", "train",
    ]  # fmt: skip
    aside = tmp_path / ("metrics.jsonl" + TORN_SUFFIX)
    assert aside.read_bytes() == torn + b"\n"
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: {metrics} ended in a torn line")
    assert f"({len(torn)} bytes" in warning[0] and str(aside) in warning[0]
    run = report.load_segments(metrics)
    assert [len(records) for _, records in run.segments] == [2, 2]
    # the run folder's next start accepts the side file as spmd's own
    assert claims.foreign_in_run_folder(tmp_path, str(tmp_path / "checkpoints")) == []


def test_a_whole_file_is_appended_to_unchanged(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    write_run(metrics, [1, 2])
    before = metrics.read_bytes()
    write_run(metrics, [3])
    assert metrics.read_bytes().startswith(before)
    assert not (tmp_path / ("metrics.jsonl" + TORN_SUFFIX)).exists()
    assert capsys.readouterr().err == ""


def test_report_reads_a_file_whose_last_line_is_being_written(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    write_run(metrics, [1, 2, 3])
    tear(metrics)
    run = report.load_segments(metrics)
    assert [r["step"] for r in run.segments[0][1]] == [1, 2]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {metrics}: its last line is cut short")


def test_report_still_refuses_a_broken_line_in_the_middle(tmp_path):
    """What an spmd before the repair left: the resumed run's config record appended onto the
    torn line."""
    metrics = tmp_path / "metrics.jsonl"
    write_run(metrics, [1, 2, 3])
    tear(metrics)
    with metrics.open("a") as f:  # no repair: appended as it was
        f.write(json.dumps({"kind": "config", **CONFIG}) + "\n")
    with pytest.raises(UsageError, match="line 4 is not a metrics record"):
        report.load_segments(metrics)
