"""Gradient bucketing (--bucket-mb) of the explicit executor and the XLA flags of a run.

Buckets: the step emits ceil(gradient bytes / bucket bytes) reductions (±1 per reduction group)
with the total bytes of the per-param reductions, and the losses of 20 steps do not move
(≤ 1e-6 relative, fp32) on dp=8, fsdp=8 ZeRO-2 / ZeRO-3 and dp=2,fsdp=2,tp=2. XLA:CPU merges
every independent all-reduce into one (its cpu-all-reduce-combiner pass; spmd.train disables
it when buckets are asked for), so all-reduces are counted in the program spmd emits (lowered)
and reduce-scatters, which XLA:CPU keeps, in the compiled one.
"""

import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from models import llama
from spmd.engine.step import build_program
from spmd.errors import UsageError
from spmd.estimate import hlo
from spmd.parallel import xla_flags
from spmd.run.builder import optimizer
from spmd.run.config import flat
from tests import cli, trainer
from tests.conftest import FAST_COMPILE_FLAGS

BUCKET_MB = 0.1  # the tiny model's 1.06 MiB of fp32 gradients: 11 buckets, leaves cut across
BUCKET = int(BUCKET_MB * 2**20)


def _program(mesh_text: str, zero: int, bucket_mb: float):
    cfg = trainer.tiny_config()
    train = flat(
        None, steps=trainer.STEPS, batch=trainer.BATCH, seq_len=trainer.SEQ_LEN, warmup=2, lr=3e-3
    )
    return build_program(
        lambda seed: llama.create(cfg, seed),
        llama.lm_loss,
        lambda names: optimizer(train)(names),
        trainer.layout(mesh_text, zero),
        executor="explicit",
        bucket_mb=bucket_mb,
    )


def _lowered(program):
    return program.lower_train_step(trainer.BATCH, trainer.SEQ_LEN)


def _reductions(stage, program, kind: str, axes: tuple[str, ...]) -> list[int]:
    """Bytes of each `kind` over `axes` that runs once per step on more than a scalar."""
    return [
        c.bytes
        for c in hlo.collectives(stage, program.layout.mesh)
        if c.kind == kind and c.axes == axes and c.count == 1 and c.bytes > 8
    ]


def _grad_bytes(program) -> int:
    return sum(
        math.prod(p.shape) * p.dtype.itemsize for p in jax.tree.leaves(program.abstract_params)
    )


def _losses(program, compiled) -> np.ndarray:
    """20 steps' losses of `compiled` (a compiled train step of `program`) from the shared
    initial state."""
    losses, _ = trainer.train_losses(program, initial=trainer.initial_state(), step_fn=compiled)
    return losses


def _compile(program):
    return program.compile_train_step(trainer.BATCH, trainer.SEQ_LEN)


def test_buckets_count_bytes_and_losses():
    # Bucket size 0 is today's step: the compiled programs the parity tests share.
    # DDP: every gradient in one reduction group; one psum per bucket.
    flat, flat_step = trainer.compiled("dp=8", 3, "explicit")
    bucketed = _program("dp=8", 3, BUCKET_MB)
    total = _grad_bytes(flat)
    per_param = _reductions(_lowered(flat), flat, "all-reduce", ("data",))
    buckets = _reductions(_lowered(bucketed), bucketed, "all-reduce", ("data",))
    assert len(per_param) == len(jax.tree.leaves(flat.abstract_params))
    assert len(buckets) == math.ceil(total / BUCKET)
    assert sum(buckets) == sum(per_param) == total
    assert max(buckets) == BUCKET // 4 * 4
    losses = _losses(bucketed, _compile(bucketed))
    assert trainer.max_relative_difference(losses, trainer.losses("dp=8", 3, "explicit")[0]) <= 1e-6

    # ZeRO-2: one psum_scatter per bucket, each device keeping 1/8 of it, in the compiled step.
    flat, flat_step = trainer.compiled("fsdp=8", 2, "explicit")
    bucketed = _program("fsdp=8", 2, BUCKET_MB)
    step = _compile(bucketed)
    per_param = _reductions(flat_step, flat, "reduce-scatter", ("fsdp",))
    buckets = _reductions(step, bucketed, "reduce-scatter", ("fsdp",))
    assert len(buckets) == math.ceil(total / BUCKET) < len(per_param)
    assert sum(buckets) == sum(per_param) == total // 8
    losses = _losses(bucketed, step)
    reference = trainer.losses("fsdp=8", 2, "explicit")[0]
    assert trainer.max_relative_difference(losses, reference) <= 1e-6

    # ZeRO-3 over fsdp alone: the reduce-scatters are the gathers' transposes inside the layer
    # loop; nothing is left to bucket and the program is the same.
    flat = trainer.compiled("fsdp=8", 3, "explicit")[0]
    assert _lowered(_program("fsdp=8", 3, BUCKET_MB)).as_text() == _lowered(flat).as_text()

    # 3-D: the data-axis psums of the fsdp shards, in two groups (tensor-split and not).
    flat, flat_step = trainer.compiled("dp=2,fsdp=2,tp=2", 3, "explicit")
    bucketed = _program("dp=2,fsdp=2,tp=2", 3, 0.05)
    per_param = _reductions(_lowered(flat), flat, "all-reduce", ("data",))
    buckets = _reductions(_lowered(bucketed), bucketed, "all-reduce", ("data",))
    lowest = math.ceil(sum(per_param) / (0.05 * 2**20))
    assert lowest <= len(buckets) <= lowest + 1 < len(per_param)
    assert sum(buckets) == sum(per_param)
    losses = _losses(bucketed, _compile(bucketed))
    reference = trainer.losses("dp=2,fsdp=2,tp=2", 3, "explicit")[0]
    assert trainer.max_relative_difference(losses, reference) <= 1e-6


def test_dry_run_shows_the_buckets_compiled():
    """spmd.train sets the XLA flags before JAX starts, after the user's own: on CPU it turns
    off the all-reduce combiner, so the compiled step keeps the buckets, and the dry run lists
    them."""
    args = ("--model", "tiny", "--devices", "8", "--mesh", "dp=8", "--collectives", "explicit")
    args += ("--bucket-mb", "0.25", "--dry-run", "--batch", "16", "--seq-len", "32")
    env = {**os.environ, "PYTHONPATH": str(cli.ROOT), "XDG_CACHE_HOME": cli.CACHE_HOME}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS  # the user's own flags: kept, spmd's added after
    result = subprocess.run(
        [sys.executable, "-m", "spmd.train", *args],
        cwd=cli.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "--xla_disable_hlo_passes=cpu-all-reduce-combiner" in result.stdout
    assert "all-reduce over data: 5 (256.00 KiB x4, 66.25 KiB; 1.06 MiB in all)" in result.stdout
    # On CPU attention is XLA's (cuDNN's fused kernel is tried on GPUs only), and it says so.
    assert "model choices while tracing: {'attention': 'xla'}" in result.stdout


def test_xla_flags_user_wins_and_presets():
    gpu = xla_flags.wanted("gpu", "throughput", 4, "auto")
    assert gpu["xla_gpu_enable_latency_hiding_scheduler"] == "true"
    assert gpu["xla_gpu_reduce_scatter_combine_threshold_bytes"] == str(4 * 2**20)
    assert set(xla_flags.wanted("gpu", "none", 4, "auto")) == set(xla_flags.GPU_THRESHOLDS)
    assert xla_flags.wanted("gpu", "none", 0, "explicit") == {}
    assert xla_flags.wanted("cpu", "throughput", 0, "explicit") == {}
    assert xla_flags.wanted("cpu", "throughput", 1, "auto") == {}
    assert xla_flags.wanted("cpu", "throughput", 1, "explicit") == xla_flags.CPU_NO_COMBINE
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    text, added, kept = xla_flags.merge(user, gpu)
    assert kept == {"xla_gpu_enable_latency_hiding_scheduler": "false"}
    assert "xla_gpu_enable_latency_hiding_scheduler" not in added
    assert xla_flags.parse(text)["xla_gpu_enable_latency_hiding_scheduler"] == "false"
    assert xla_flags.parse(text)["xla_gpu_all_gather_combine_threshold_bytes"] == str(4 * 2**20)
    assert text.startswith(user)
    assert xla_flags.parse("--a --b=1 -c=x") == {"a": "true", "b": "1", "c": "x"}
    for bad in (
        lambda: xla_flags.wanted("gpu", "fast", 0, "auto"),
        lambda: xla_flags.wanted("gpu", "none", -1, "auto"),
    ):
        with pytest.raises(UsageError):
            bad()
    # In-process (the tests' backend is running): nothing is left in the environment.
    record = xla_flags.apply("throughput", 1, "explicit")
    assert record["set"] == {} and "already started" in record["note"]
    assert "cpu-all-reduce-combiner" not in record["xla_flags"]
