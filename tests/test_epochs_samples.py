"""`--epochs N` (spmd.io.epochs) and samples while training (spmd.run.samples), on one shared
set of tiny runs under dp=2,fsdp=2,tp=2, run from their parent folder with relative paths:

- `--epochs 2` on W windows at global batch B runs ceil(2W / B) steps and reads each window
  exactly twice in its first 2W reads (the summary's counts, and the ids recomputed here);
- a run stopped after step 6, its folder moved, and resumed from the moved folder's
  config.toml gives the train records (loss, epoch) of an uninterrupted run, bit for bit,
  although only the interrupted one samples: sampling leaves the trajectory alone;
- its samples equal spmd.generate's greedy output from the checkpoint of the same step;
- the bad inputs exit 2 in one line."""

import contextlib
import io
import json
import math
import shutil

import numpy as np
import pytest

from spmd import generate, report
from spmd.io import data, epochs, mixture
from spmd.observe import trackers
from tests.cli import records, train_in_process

SEQ_LEN, BATCH, EPOCHS, NEW_TOKENS = 32, 8, 2, 10
TEXT = "abcdefghijklmnopqrstuvwxyz" * 56  # 1,456 bytes: greedy samples change within 8 steps
# a text file's tokens: its bytes and a separator (spmd.io.tokens); no eval split
WINDOWS = (len(TEXT) + 1 - 1) // SEQ_LEN  # 45 windows of 33 tokens
STEPS = math.ceil(EPOCHS * WINDOWS / BATCH)  # 12
PROMPTS = ["abc", "mnop"]
COMMON = ["--model", "tiny", "--mesh", "dp=2,fsdp=2,tp=2", "--batch", str(BATCH)]
COMMON += ["--seq-len", str(SEQ_LEN), "--lr", "1e-2", "--warmup", "2"]
COMMON += ["--eval-fraction", "0", "--log-every", "1", "--tracker", "tensorboard"]
COMMON += ["--data", "corpus.txt", "--data-cache", "tokens"]
ARGS = [*COMMON, "--epochs", str(EPOCHS)]
SAMPLING = ["--sample-every", "4", "--sample-prompts", "prompts.txt"]
SAMPLING += ["--sample-max-new-tokens", str(NEW_TOKENS), "--checkpoint-every", "4"]


def trained(result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the scratch folder, the moved run folder of the interrupted and resumed run that
    samples, the uninterrupted run's folder)."""
    top = tmp_path_factory.mktemp("epochs")
    (top / "corpus.txt").write_text(TEXT)
    (top / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(top)
        trained(train_in_process(*ARGS, *SAMPLING, "--run-dir", "first", "--stop-after", "6"))
        shutil.move("first", "moved")
        trained(train_in_process("--config", "moved/config.toml", "--run-dir", "moved"))
        trained(train_in_process(*ARGS, "--run-dir", "whole", "--checkpoint-dir", "none"))
    return top, top / "moved", top / "whole"


def train_records(folder) -> list[tuple]:
    kept = [r for r in records(folder / "metrics.jsonl") if r["kind"] == "train"]
    return [(r["step"], r["loss"], r["grad_norm"], r["epoch"]) for r in kept]


def test_epochs_run_ceil_2w_over_b_steps_and_read_each_window_twice(runs):
    _, _, whole = runs
    steps = train_records(whole)
    assert [s for s, *_ in steps] == list(range(1, STEPS + 1))
    read = [s * BATCH / WINDOWS for s, *_ in steps]  # windows read / W
    assert [e for *_, e in steps] == pytest.approx(read, abs=2e-6)
    (summary,) = [r for r in records(whole / "metrics.jsonl") if r["kind"] == "summary"]
    extra = STEPS * BATCH - EPOCHS * WINDOWS  # the last step's rows of epoch 3
    assert summary["steps"] == STEPS and summary["epochs"] == pytest.approx(STEPS * BATCH / WINDOWS)
    assert summary["windows_per_epoch"] == [
        {"epoch": 1, "reads": WINDOWS, "distinct": WINDOWS},
        {"epoch": 2, "reads": WINDOWS, "distinct": WINDOWS},
        {"epoch": 3, "reads": extra, "distinct": extra},
    ]
    # the ids the run's batches are made of: in the first 2W reads every window twice
    ids = np.concatenate(
        [data.train_window_ids(0, t, BATCH, WINDOWS, stream=True) for t in range(STEPS)]
    )
    assert np.bincount(ids[: EPOCHS * WINDOWS], minlength=WINDOWS).tolist() == [2] * WINDOWS
    assert sorted(ids[:WINDOWS]) == list(range(WINDOWS))  # epoch 1 is a permutation
    assert not np.array_equal(ids[:WINDOWS], ids[WINDOWS : 2 * WINDOWS])  # reshuffled


def test_an_interrupted_resumed_sampling_run_equals_an_uninterrupted_one(runs):
    _, moved, whole = runs
    assert train_records(moved) == train_records(whole)  # losses, gradient norms, epochs
    kinds = [r["kind"] for r in records(moved / "metrics.jsonl")]
    assert kinds.count("resume") == 1 and kinds.count("stopped") == 1


def test_samples_equal_generate_greedy_from_the_same_steps_checkpoint(runs):
    top, moved, _ = runs
    rows = [json.loads(line) for line in (moved / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in rows] == [
        (step, prompt) for step in (4, 8, 12) for prompt in PROMPTS
    ]
    by_step = {s: [r["completion"] for r in rows if r["step"] == s] for s in (4, 8)}
    assert by_step[4] != by_step[8]  # from the params of the step, which changed
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.chdir(top)
        args = ["--checkpoint", "moved/checkpoints", "--step", "8", "--prompts-file"]
        args += ["prompts.txt", "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)]
        assert generate.main([*args, "--mesh", "dp=2,fsdp=2,tp=2"]) == 0
    printed = out.getvalue().split("=== sample ")[1:]
    expected = [
        f"{i + 1} ===\n{p}{c}\n" for i, (p, c) in enumerate(zip(PROMPTS, by_step[8], strict=True))
    ]
    assert printed == expected


def test_the_report_shows_the_epoch_and_writes_the_samples(runs, capsys):
    _, moved, _ = runs
    assert report.main([str(moved)]) == 0
    assert f"({STEPS * BATCH / WINDOWS:.2f} epochs, 1 resume(s))" in capsys.readouterr().out
    rows = [json.loads(line) for line in (moved / "samples.jsonl").read_text().splitlines()]
    table = trackers.samples_markdown([r for r in rows if r["step"] == 8])
    assert f"## step 8\n\n{table}\n" in (moved / "samples.md").read_text()


def test_samples_reach_tensorboard_as_text(runs):
    _, moved, _ = runs
    events = b"".join(p.read_bytes() for p in (moved / "tensorboard").glob("events.*"))
    rows = [json.loads(line) for line in (moved / "samples.jsonl").read_text().splitlines()]
    table = trackers.samples_markdown([r for r in rows if r["step"] == 8])
    assert table.encode() in events  # the text summary's tensor holds the Markdown as it is


def test_a_mixtures_epochs_are_its_first_sources():
    sources = [data.TokenWindows(np.arange(n * 4 + 1) % 256, 4, 0.0) for n in (30, 7)]
    mix = mixture.Mixture(["sft", "web"], sources, [0.75, 0.25], 8)  # 6 and 2 rows a step
    passes = epochs.passes(mix, 8)
    assert (passes.total, passes.per_step, passes.steps_for(3)) == (30, 6, 15)
    counts = epochs.windows_per_epoch(mix, 0, 8, list(range(15)))
    assert counts == [{"epoch": e, "reads": 30, "distinct": 30} for e in (1, 2, 3)]


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--steps", "5"], "--epochs 2 and --steps 5 both say how long to train"),
        (["--sample-every", "2"], "--sample-every 2 needs --sample-prompts FILE"),
        (["--sample-every", "2", "--sample-prompts", "nowhere.txt"], "--sample-prompts nowhere"),
        (["--sample-prompts", "prompts.txt"], "needs --sample-every N"),
        (["--epochs", "-1"], "--epochs -1 must be a positive integer"),
    ],
)
def test_bad_inputs_exit_2_in_one_line(extra, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("a\n")
    result = train_in_process(*ARGS, "--run-dir", "r", *extra)
    assert result.returncode == 2
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()  # refused before the run folder


def test_a_steps_checkpoint_does_not_resume_as_epochs(runs, tmp_path, monkeypatch):
    top, moved, _ = runs
    monkeypatch.chdir(top)
    result = train_in_process(*COMMON, "--steps", "12", "--checkpoint-dir", "moved/checkpoints")
    assert result.returncode == 2 and "trained with --epochs" in result.stderr, result.stderr
