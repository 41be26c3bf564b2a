"""The LR schedules of --lr-schedule, each checked point by point against its formula written out
here: what the optimizer applies (one parameter, constant gradient: Adam's step is the LR) and
what the metrics records say, including across a resume in the middle of WSD's decay."""

import math
import sysconfig
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from spmd import train
from spmd.engine.optim import lr_schedule
from spmd.engine.optimizers import make_optimizer
from spmd.sections import OptimizerConfig
from tests.cli import records

SCHEDULES = ["cosine", "linear", "constant", "wsd"]
STEPS, WARMUP, DECAY_FRACTION, PEAK, RATIO = 10, 2, 0.3, 1e-2, 0.1


def expected_lr(schedule: str, step: int, steps: int = STEPS) -> float:
    """The LR of optimizer step `step` (1-based; it reads count step - 1) by the formulas of
    docs/operations.md: warm-up from 0, then the schedule's decay to RATIO x PEAK."""
    count, end = step - 1, PEAK * RATIO
    if count < WARMUP:
        return PEAK * count / WARMUP
    span = steps - WARMUP  # the decays reach `end` at count `steps`, after the last step
    if schedule == "cosine":
        return end + (PEAK - end) * 0.5 * (1 + math.cos(math.pi * (count - WARMUP) / span))
    if schedule == "linear":
        return PEAK + (end - PEAK) * (count - WARMUP) / span
    if schedule == "constant":
        return PEAK
    final = round(DECAY_FRACTION * steps)  # wsd: stable at the peak, then the last `final`
    stable_until = steps - final
    return PEAK if count < stable_until else PEAK + (end - PEAK) * (count - stable_until) / final


def optimizer_config(schedule: str) -> OptimizerConfig:
    return OptimizerConfig(
        lr=PEAK,
        warmup=WARMUP,
        lr_schedule=schedule,
        min_lr_ratio=RATIO,
        decay_fraction=DECAY_FRACTION,
        weight_decay=0.0,
        grad_clip=0.0,
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_optimizer_applies_the_schedule(schedule):
    # A vector param (no weight decay) under a constant gradient of 1: Adam's bias-corrected
    # moments are 1 and 1, so each update is -LR / (1 + eps).
    tx = make_optimizer(optimizer_config(schedule), STEPS, 32, {"w": ("embed",)})
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    applied = []
    for _ in range(STEPS):
        updates, state = tx.update({"w": jnp.ones(3)}, state, params)
        applied.append(-float(updates["w"][0]) * (1 + 1e-8))
    want = [expected_lr(schedule, step) for step in range(1, STEPS + 1)]
    np.testing.assert_allclose(applied, want, rtol=1e-5, atol=1e-12)


def test_wsd_phases_fall_on_their_steps():
    lr = lr_schedule(optimizer_config("wsd"), STEPS, 32)
    by_step = {step: float(lr(step - 1)) for step in range(1, STEPS + 1)}
    assert by_step[1] == 0 and 0 < by_step[2] < PEAK  # warm-up: steps 1-2
    assert all(by_step[step] == pytest.approx(PEAK) for step in range(3, 9))  # stable: 3-8
    assert PEAK > by_step[9] > by_step[10] > PEAK * RATIO  # decay: 3 counts from step 8's
    assert float(lr(STEPS)) == pytest.approx(PEAK * RATIO)  # ... reaching the end after 10


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lr_schedule": "step"}, "--lr-schedule 'step' is not one of cosine, linear, constant"),
        ({"decay_fraction": 0.0}, "--decay-fraction 0 must be a fraction of --steps in (0, 1]"),
        ({"decay_fraction": 1.5}, "--decay-fraction 1.5 must be a fraction of --steps in (0, 1]"),
        ({"warmup": 8}, "--warmup 8 plus the 3 decay steps (--decay-fraction 0.3 of --steps 10)"),
    ],
)
def test_bad_schedule_settings_exit_2_naming_them(changes, message, capsys):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in changes.items()]
    base = ["--model", "tiny", "--lr-schedule", "wsd", "--steps", "10", "--decay-fraction", "0.3"]
    assert train.main([*base, "--dry-run", *flags]) == 2  # before any data or device work
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedules")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:4]
    (root / "corpus.txt").write_text("".join(p.read_text() for p in stdlib))
    return root


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_metrics_records_follow_the_schedule_across_a_resume(corpus, tmp_path, schedule):
    """The run stops after step 8 (WSD: the decay's first step) and the same command continues
    it: the records of steps 1-10 hold the schedule's LR, the resumed ones too."""
    metrics = tmp_path / "m.jsonl"
    args = ["--model", "tiny", "--mesh", "dp=8", "--batch", "8", "--seq-len", "16"]
    args += ["--steps", str(STEPS), "--warmup", str(WARMUP), "--lr", str(PEAK)]
    args += ["--lr-schedule", schedule, "--decay-fraction", str(DECAY_FRACTION)]
    args += ["--min-lr-ratio", str(RATIO), "--log-every", "1", "--eval-fraction", "0"]
    args += ["--data", str(corpus / "corpus.txt"), "--data-cache", str(corpus / "tokens")]
    args += ["--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(metrics)]
    assert train.main([*args, "--stop-after", "8"]) == 0
    assert train.main(args) == 0
    logged = {r["step"]: r["lr"] for r in records(metrics) if r["kind"] == "train"}
    assert sorted(logged) == list(range(1, STEPS + 1))
    want = {step: expected_lr(schedule, step) for step in logged}
    assert logged == pytest.approx(want, rel=1e-5, abs=1e-12)
    assert any(r["kind"] == "resume" and r["step"] == 8 for r in records(metrics))


def test_the_default_is_optax_warm_up_then_cosine():
    cfg = OptimizerConfig(lr=3e-3, warmup=20, min_lr_ratio=0.1)
    ours = lr_schedule(cfg, 200, 32)
    optax_own = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 200, 3e-4)
    assert [float(ours(c)) for c in range(202)] == [float(optax_own(c)) for c in range(202)]
