"""`python -m spmd.bench` runs the framework's step beside the bare jax.jit step of the same
math, under fp32 and bf16 (speed itself is measured by running it, never asserted here)."""

import re

import pytest

from spmd import bench, train

TINY = ["--model", "tiny", "--steps", "2", "--rounds", "1", "--batch", "8", "--seq-len", "32"]


def test_bf16_bench_runs_both_steps_and_prints_their_ratio(capsys):
    assert bench.main([*TINY, "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert ", bf16, --collectives auto," in out
    assert re.search(r"spmd / bare step time: \d+\.\d{3}", out), out


def test_a_lora_bench_runs_the_bare_step_on_the_adapters_alone(capsys):
    """issue 55: the bare step ran the family's loss on the LoRA model, which has only the
    CausalLM pieces (no `token_losses`), and differentiated the frozen base: every family's
    LoRA bench failed. An MoE model with dropout: the adapted loss, masks and router losses."""
    lora = ["--lora-rank", "4", "--lora-dropout", "0.1", "--mesh", "dp=1", "--batch", "4"]
    lora += ["--seq-len", "16", "--steps", "2", "--rounds", "1"]
    assert bench.main(["--model", "moe-tiny", *lora]) == 0
    assert re.search(r"spmd / bare step time: \d+\.\d{3}", capsys.readouterr().out)


def test_fp16_is_refused_with_the_valid_choices(capsys):
    assert bench.main([*TINY, "--precision", "fp16"]) == 2
    assert "use fp32 or bf16" in capsys.readouterr().err


# Layouts whose program the builder shapes beyond a plain mesh: a pipeline schedule, sequence
# parallelism, the context axis, the experts' axis (an MoE model).
SAME_STEP_LAYOUTS = {
    "pp=2": ["--model", "tiny", "--mesh", "pp=2", "--microbatches", "2"],
    "tp=2 + SP": ["--model", "tiny", "--mesh", "tp=2", "--sequence-parallel"],
    "cp=2": ["--model", "tiny", "--mesh", "cp=2"],
    "ep=2": ["--model", "moe-tiny", "--mesh", "ep=2"],
}


def _fingerprint(out: str) -> str:
    found = re.findall(r"train step HLO fingerprint ([0-9a-f]{16})", out)
    assert len(found) == 1, out
    return found[0]


@pytest.mark.parametrize("layout", SAME_STEP_LAYOUTS)
def test_bench_times_the_step_that_train_compiles(layout, capsys):
    """spmd.bench and spmd.train --dry-run build their program through spmd.run.builder from the
    same flags: the compiled steps are the same module (source locations aside)."""
    args = [*SAME_STEP_LAYOUTS[layout], "--batch", "4", "--seq-len", "32"]
    args += ["--steps", "2"]  # the LR schedule is part of the step
    assert train.main([*args, "--dry-run"]) == 0
    trained = _fingerprint(capsys.readouterr().out)
    assert bench.main([*args, "--rounds", "1"]) == 0
    benched = capsys.readouterr().out
    assert _fingerprint(benched) == trained
    if layout == "pp=2":  # the schedule the benchmark runs is printed, as training prints it
        assert "pipeline: gpipe over 2 stages" in benched
