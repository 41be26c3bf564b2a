"""`python -m spmd.bench` runs the framework's step beside the bare jax.jit step of the same
math, under fp32 and bf16 (speed itself is measured by running it, never asserted here)."""

import re

from spmd import bench

TINY = ["--model", "tiny", "--steps", "2", "--rounds", "1", "--batch", "8", "--seq-len", "32"]


def test_bf16_bench_runs_both_steps_and_prints_their_ratio(capsys):
    assert bench.main([*TINY, "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert ", bf16, --collectives auto," in out
    assert re.search(r"spmd / bare step time: \d+\.\d{3}", out), out


def test_fp16_is_refused_with_the_valid_choices(capsys):
    assert bench.main([*TINY, "--precision", "fp16"]) == 2
    assert "use fp32 or bf16" in capsys.readouterr().err
