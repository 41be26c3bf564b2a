"""What `python -m spmd.train` reports for precision, accumulation and activation checkpointing:
the compiled per-device temp memory of the chosen --remat (lower with full recomputation) and
the batch self-check at start."""

import re

import pytest

from spmd import train
from spmd.run import checks
from spmd.run.config import flat

# The runs differ only in --remat, so the temp memory difference is the policy's.
SAME = ["--model", "tiny", "--mesh", "dp=-1", "--batch", "16", "--seq-len", "64"]
SAME += ["--precision", "fp16", "--accum", "2", "--dry-run"]


def temp_mib(out: str, remat: str) -> float:
    line = re.search(rf"temp ([\d.]+) MiB with --remat {remat} ", out)
    assert line, out
    return float(line.group(1))


def test_dry_run_shows_remat_temp_memory_and_the_batch_self_check(capsys):
    assert train.main([*SAME, "--remat", "none"]) == 0
    none = temp_mib(capsys.readouterr().out, "none")
    assert train.main([*SAME, "--remat", "full"]) == 0
    out = capsys.readouterr().out
    assert 0 < temp_mib(out, "full") < 0.9 * none  # 2.78 vs 3.36 MiB on XLA:CPU
    assert (
        "per-device micro-batch 1 x accum 2 x data-parallel 8 = global batch 16 sequences "
        "(1,024 tokens/step) | base lr 0.003 (no scaling) -> 0.003" in out
    )
    formula = re.search(r"state per device against the ZeRO formula \(2 \+ 2 \+ 12 B/param.*", out)
    assert formula and formula.group(0).count("(x1.000)") == 2, out  # params; master + Adam
    assert (
        "precision fp16: params fp16 (master fp32 in the optimizer state), compute fp16, "
        "grad reduce fp16" in out
    )


def test_batch_arithmetic_with_the_linear_scaling_rule():
    cfg = flat(None, batch=256, accum=4, seq_len=128, lr=1e-3, lr_scaling="linear", ref_batch=64)
    check = checks.batch_arithmetic(cfg, data_parallel=8)
    assert check["micro_batch_per_device"] * check["accum"] * check["data_parallel"] == 256
    assert check["micro_batch_per_device"] == 8 and check["tokens_per_step"] == 256 * 128
    assert check["peak_lr"] == 4e-3
    assert "base lr 0.001 x 256/64 (linear scaling) -> 0.004" in checks.format_batch_arithmetic(
        check
    )


def test_metrics_lines_are_strict_json_even_for_a_skipped_steps_infinite_norm(tmp_path):
    import json

    from spmd.observe.metrics import MetricsLog

    log = MetricsLog(str(tmp_path / "m.jsonl"))
    log.write("train", step=3, grad_norm=float("inf"), loss=2.5, extra={"x": [float("nan")]})
    log.close()
    line = (tmp_path / "m.jsonl").read_text()
    assert "Infinity" not in line and "NaN" not in line
    record = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict {c}"))
    assert (
        record["grad_norm"] is None and record["loss"] == 2.5 and record["extra"] == {"x": [None]}
    )
