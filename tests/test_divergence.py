"""A diverging run never costs its good checkpoints: non-finite and spiking losses are noticed on
every step, the run stops (exit 3) or rolls back, and only finite states are ever saved.

Every run is `spmd.train.main` in this process: the stopping run made to diverge by a huge LR,
the rollback and rotation runs with a fault injected into the compiled step (NaN params fed to
one call, as test_precision injects an fp16 overflow); all of them train the same 12-step schedule,
so they share one compiled step, and the rollback's reference run reuses the step that the
resumed run compiled for the lowered LR."""

import json
import shutil
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from spmd import train
from spmd.io import checkpoint, data, tokens
from spmd.sections import DivergenceConfig
from spmd.training import divergence
from spmd.training.resume import program_state_target
from tests.cli import records, train_in_process
from tests.tiny_run import tiny_program

RUN = ["--model", "tiny", "--steps", "12", "--batch", "8", "--seq-len", "32", "--log-every", "1"]
RUN += ["--eval-fraction", "0", "--warmup", "2", "--mesh", "dp=8"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("divergence")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:6]
    (root / "corpus.txt").write_text("".join(p.read_text() for p in stdlib))
    return root


def data_args(root: Path) -> list[str]:
    return ["--data", str(root / "corpus.txt"), "--data-cache", str(root / "tokens")]


def train_records(path: Path) -> list[dict]:
    return [r for r in records(path) if r["kind"] == "train"]


def saved_data_state(directory: Path, step: int) -> dict:
    return json.loads((directory / str(step) / "data" / "metadata").read_text())


# -- detection and the data order, without devices ------------------------------------------


def test_skipped_data_steps_shift_the_later_steps_only():
    assert [data.data_step(t, []) for t in (1, 2, 3)] == [0, 1, 2]
    assert [data.data_step(t, [4, 5, 6]) for t in range(3, 8)] == [2, 3, 7, 8, 9]
    assert [data.data_step(t, [0, 2]) for t in (1, 2, 3)] == [1, 3, 4]


def test_guard_flags_non_finite_values_and_spikes_against_the_running_median():
    def check(guard, step, loss, grad_norm=1.0):
        return guard.check(step, {"loss": loss, "grad_norm": grad_norm})

    guard = divergence.Guard(DivergenceConfig(spike_threshold=3, spike_window=4), "fp32")
    assert check(guard, 1, 5.0) is None and check(guard, 2, 4.0) is None
    assert check(guard, 3, 13.0) is None  # 13 < 3 x median(5, 4) = 13.5
    assert check(guard, 4, 14.0) is None  # median(5, 4, 13) = 5
    spike = check(guard, 5, 30.0)  # median(5, 4, 13, 14) = 9
    assert spike.what == "spike" and spike.finite and guard.refusal(5) is None
    assert "above 3 x 9, the median of the last 4 losses" in spike.reason
    assert check(guard, 6, float("nan")).what == "loss" and guard.refusal(6) == "loss nan"
    assert check(guard, 7, 3.0, float("inf")).what == "grad_norm"
    assert [s for s, _ in guard.history] == [1, 2, 3, 4]  # diverged losses stay out
    # fp16's loss scale skips a step with an infinite gradient itself: not a divergence.
    fp16 = divergence.Guard(DivergenceConfig(), "fp16")
    assert check(fp16, 1, 3.0, float("inf")) is None
    assert check(fp16, 2, float("inf")).what == "loss"
    # What a checkpoint saves of the guard makes a resumed one judge spikes the same way.
    resumed = divergence.Guard(guard.cfg, "fp32", guard.saved_fields(4))
    assert list(resumed.history) == list(guard.history)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--on-divergence", "halt"], "--on-divergence 'halt' is not one of stop, rollback"),
        (["--on-divergence", "rollback"], "--on-divergence rollback needs --checkpoint-dir"),
        (["--spike-threshold", "0.5"], "--spike-threshold 0.5 must be 0 (off) or a factor above 1"),
        (["--rollback-lr-factor", "2"], "--rollback-lr-factor 2 must be in (0, 1]"),
        (["--max-rollbacks", "-1"], "--max-rollbacks -1 must be 0 or more"),
        (["--weight-decay", "nan"], "--weight-decay nan must be 0 or a positive number"),
        (["--min-lr-ratio", "inf"], "--min-lr-ratio inf must be a fraction of --lr in [0, 1]"),
    ],
)
def test_divergence_and_optimizer_flags_out_of_range_exit_2(args, message, capsys):
    assert train.main(["--model", "tiny", "--dry-run", *args]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {message}") and len(error.strip().splitlines()) == 1


# -- stop: a real diverging run --------------------------------------------------------------


def test_a_diverging_run_stops_with_status_3_and_leaves_only_finite_checkpoints(corpus):
    directory, metrics = corpus / "stop", corpus / "stop.jsonl"
    args = [*RUN, *data_args(corpus), "--lr", "1e3", "--checkpoint-every", "2"]
    args += ["--checkpoint-dir", str(directory), "--metrics", str(metrics)]
    result = train_in_process(*args)
    assert result.returncode == divergence.DIVERGED_EXIT, result.stdout[-2000:] + result.stderr
    trained = train_records(metrics)
    [anomaly] = [r for r in records(metrics) if r["kind"] == "anomaly"]
    first = next(r["step"] for r in trained if r["loss"] is None or r["grad_norm"] is None)
    # Stopped at the first non-finite step: nothing was reported or saved after it.
    assert anomaly["step"] == first == trained[-1]["step"] and anomaly["action"] == "stop"
    last_line = result.stderr.strip().splitlines()[-1]
    steps = checkpoint.complete_steps(str(directory))
    newest = steps[-1]
    # The checkpoint of the step before, if any, held the params that diverged: set aside.
    assert {p.name for p in directory.iterdir()} <= {*map(str, steps), f"{first - 1}.diverged"}
    assert last_line.startswith(f"diverged at step {first} (") and "exit status 3" in last_line
    assert f"newest checkpoint, step {newest} in {directory}, is finite" in last_line
    assert anomaly["checkpoint_step"] == newest < first
    # Every checkpoint left restores to finite params with a finite loss.
    program = tiny_program("dp=8")
    windows = corpus_windows(corpus)
    batch = data.global_batch(
        windows, data.train_window_ids(0, 0, 8, windows.n_train), program.layout.batch_sharding()
    )
    manager = checkpoint.open_manager(str(directory), keep=3)
    for step in checkpoint.complete_steps(str(directory)):
        state = manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(program_state_target(program))),
        )["state"]
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state["params"])), step
        params = program.from_checkpoint(state).params
        assert np.isfinite(float(program.eval_step(params, batch))), step
        assert np.isfinite(saved_data_state(directory, step)["loss"])
    manager.close()


# -- rollback and rotation: in-process runs with an injected fault ---------------------------


class Faulty:
    """A compiled train step that is fed NaN params on the calls numbered in `at` (1-based): a
    fault that makes that step's loss non-finite, as a corrupted batch or a bit flip would."""

    def __init__(self, step_fn, at: tuple[int, ...] = ()):
        self.step_fn, self.at, self.calls = step_fn, at, 0

    def __call__(self, params, *rest):
        self.calls += 1
        if self.calls in self.at:
            params = jax.tree.map(lambda p: jax.device_put(p * jnp.nan, p.sharding), params)
        return self.step_fn(params, *rest)


SHARED: dict = {}  # the compiled step of RUN's 12-step schedule, made by the first run


@pytest.fixture
def compiled_steps(monkeypatch):
    """Patch spmd.train.compile_step: the first run compiles the 12-step schedule's step, later
    runs reuse it (`reuse`), a fault goes in through `fault_at`, and `last` is what a run got."""
    real = train.compile_step
    shared = SHARED

    class Steps:
        fault_at: tuple[int, ...] = ()
        reuse = True
        last = None

    def compile_step(cfg, program):
        if Steps.reuse and "step" in shared:
            compiled, facts = shared["step"]
        else:
            compiled, facts = real(cfg, program)
            shared.setdefault("step", (compiled, facts))
        Steps.last = compiled
        return Faulty(compiled, Steps.fault_at), facts

    monkeypatch.setattr(train, "compile_step", compile_step)
    return Steps


def test_rollback_skips_the_undone_windows_like_a_run_from_that_checkpoint(
    corpus, tmp_path, compiled_steps
):
    directory, metrics = tmp_path / "ck", tmp_path / "rollback.jsonl"
    args = [*RUN, *data_args(corpus), "--on-divergence", "rollback", "--rollback-lr-factor",
            "0.5", "--checkpoint-every", "2", "--keep-checkpoints", "9"]  # fmt: skip
    compiled_steps.fault_at = (7,)  # step 7 diverges; step 8 is already dispatched
    assert train.main([*args, "--checkpoint-dir", str(directory), "--metrics", str(metrics)]) == 0
    [anomaly] = [r for r in records(metrics) if r["kind"] == "anomaly"]
    assert anomaly["step"] == 7 and anomaly["what"] == "loss" and anomaly["action"] == "rollback"
    # The checkpoint of step 6 held the params step 7 diverged on: set aside, 4 restored.
    assert anomaly["restored_step"] == 4 and anomaly["set_aside"] == str(directory / "6.diverged")
    assert anomaly["skipped_data_steps"] == [4, 5, 6] and anomaly["lr_factor"] == 0.5
    trained = train_records(metrics)
    assert [r["step"] for r in trained] == [*range(1, 8), *range(5, 13)]  # all 12 steps done
    after = {r["step"]: r["loss"] for r in trained[7:]}
    assert all(np.isfinite(loss) for loss in after.values())
    assert checkpoint.complete_steps(str(directory)) == [2, 4, 6, 8, 10, 12]
    assert (directory / "6.diverged").is_dir()
    assert saved_data_state(directory, 4)["skipped_data_steps"] == []
    assert saved_data_state(directory, 8)["skipped_data_steps"] == [4, 5, 6]
    assert saved_data_state(directory, 8)["lr_factor"] == 0.5

    # Resumed from its step-8 checkpoint, the run reads the same windows at the same lowered LR.
    resumed_dir, resumed_metrics = tmp_path / "resumed", tmp_path / "resumed.jsonl"
    shutil.copytree(directory, resumed_dir)
    for step in (10, 12):
        shutil.rmtree(resumed_dir / str(step))
    compiled_steps.fault_at, compiled_steps.reuse = (), False  # compiles the LR x 0.5 step
    resume = ["--checkpoint-dir", str(resumed_dir), "--resume", "--metrics", str(resumed_metrics)]
    assert train.main([*args, *resume]) == 0
    resumed = {r["step"]: r["loss"] for r in train_records(resumed_metrics)}
    assert resumed == {step: after[step] for step in range(9, 13)}  # bitwise

    # The reference: checkpoint 4 run by hand over the windows of data steps 7..14 (4, 5, 6
    # skipped) with the lowered-LR step the resumed run compiled.
    reference = reference_losses(directory / "4", compiled_steps.last, corpus, range(7, 15))
    assert reference == [after[step] for step in range(5, 13)]  # bitwise


def reference_losses(step_dir: Path, step_fn, corpus: Path, data_steps: range) -> list[float]:
    """Losses of `step_fn` run from the checkpoint in `step_dir` over the given data steps."""
    program = tiny_program("dp=8")
    manager = checkpoint.open_manager(str(step_dir.parent), keep=9)
    target = ocp.args.StandardRestore(program_state_target(program))
    state = manager.restore(int(step_dir.name), args=ocp.args.Composite(state=target))["state"]
    manager.close()
    windows = corpus_windows(corpus)
    losses = []
    params, opt_state, loss_scale = program.from_checkpoint(state)
    for data_step in data_steps:
        ids = data.train_window_ids(0, data_step, 8, windows.n_train)
        batch = data.global_batch(windows, ids, program.layout.batch_sharding())
        params, opt_state, loss_scale, metrics = step_fn(params, opt_state, loss_scale, batch)
        losses.append(float(metrics["loss"]))
    return losses


def corpus_windows(corpus: Path) -> data.TokenWindows:
    token_file = tokens.open_tokens(str(corpus / "corpus.txt"), "", str(corpus / "tokens"))
    return data.TokenWindows(token_file.load(), 32, 0)


def test_keep_2_holds_the_newest_finite_step_through_three_refused_saves(
    corpus, tmp_path, compiled_steps
):
    directory, metrics = tmp_path / "ck", tmp_path / "ignore.jsonl"
    compiled_steps.fault_at = (5,)  # NaN params from step 5 on: they stay NaN
    args = [*RUN, *data_args(corpus), "--on-divergence", "ignore", "--checkpoint-every", "2",
            "--keep-checkpoints", "2", "--stop-after", "10", "--checkpoint-dir", str(directory),
            "--metrics", str(metrics)]  # fmt: skip
    assert train.main(args) == 0  # `ignore` goes on to the end, as before
    lines = records(metrics)
    refused = [r["step"] for r in lines if r["kind"] == "checkpoint_refused"]
    assert refused == [6, 8, 10]
    assert [r["step"] for r in lines if r["kind"] == "anomaly"] == [5, 6, 7, 8, 9, 10]
    assert checkpoint.complete_steps(str(directory)) == [2, 4]  # 4: the newest finite step
    assert np.isfinite(saved_data_state(directory, 4)["loss"])
