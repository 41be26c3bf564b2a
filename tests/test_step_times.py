"""Every step is timed (spmd.training.step_clock): the closing line's and the summary's median
are the median of the per-step times the train records hold, over the steps that include no
eval, save or compile, and those steps are marked."""

import statistics
import sysconfig
from pathlib import Path

from spmd import train
from spmd.training.step_clock import StepClock, percentile
from tests.cli import records

STEPS = 8
ARGS = ["--model", "tiny", "--mesh", "dp=1", "--batch", "4", "--seq-len", "16"]
ARGS += ["--steps", str(STEPS), "--warmup", "2", "--log-every", "1", "--eval-every", "3"]
ARGS += ["--eval-batches", "1", "--checkpoint-every", "5"]


def test_percentile_is_the_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 11)], 90) == 9.0
    assert percentile([5.0], 90) == 5.0
    clock = StepClock(1)
    for step in (1, 2, 3):
        clock.tick(step)
    assert clock.includes == {1: ["compile"], 2: [], 3: []}


def test_the_closing_median_is_the_median_of_the_logged_step_times(tmp_path, capsys):
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:3]
    (tmp_path / "corpus.txt").write_text("".join(p.read_text() for p in stdlib))
    data = ["--data", str(tmp_path / "corpus.txt"), "--data-cache", str(tmp_path / "tokens")]
    metrics = tmp_path / "metrics.jsonl"
    where = ["--metrics", str(metrics), "--checkpoint-dir", str(tmp_path / "ck")]
    assert train.main([*ARGS, *data, *where]) == 0
    out = capsys.readouterr().out
    rows = records(metrics)
    steps = {r["step"]: r for r in rows if r["kind"] == "train"}
    assert sorted(steps) == list(range(1, STEPS + 1))  # every step logged, each its own time
    marks = {s: r["step_includes"] for s, r in steps.items() if r["step_includes"]}
    # step 1 runs the compiled step first; evals after 3 and 6 and the save after 5 are in the
    # next step's interval
    assert marks == {1: ["compile"], 4: ["eval"], 6: ["save"], 7: ["eval"]}
    plain = [r["step_time_s"] for s, r in steps.items() if s not in marks]
    summary = next(r for r in rows if r["kind"] == "summary")
    assert summary["median_step_time_s"] == statistics.median(plain)
    assert summary["p90_step_time_s"] == percentile(plain, 90)
    assert summary["plain_steps"] == len(plain) and summary["timed_steps"] == STEPS
    assert summary["marked_steps"] == {"compile": 1, "eval": 2, "save": 1}
    closing = f"median {statistics.median(plain) * 1e3:.1f} ms/step"
    assert closing in out and f"p90 {percentile(plain, 90) * 1e3:.1f}" in out
