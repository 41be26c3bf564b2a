"""Pipeline parallelism: the tick tables, the user errors, loss parity of every schedule with one
device, the 3-D composition, and 1F1B's memory that does not grow with the micro-batch count."""

import functools

import jax
import numpy as np
import optax
import pytest

from models import llama
from spmd.engine.state_layout import state_bytes_per_device
from spmd.errors import UsageError
from spmd.estimate import hlo, theory
from spmd.io import data
from spmd.parallel import schedules
from spmd.parallel.pipeline import Pipeline, check
from tests import trainer
from tests.cli import records, train_in_process

GRID_STEPS = 5  # the schedule x stages x micro-batches grid; the 3-D run keeps all 20 steps


def compile_step(prog, batch: int = trainer.BATCH):
    """The program's train step compiled ahead of time for `batch` sequences."""
    return prog.compile_train_step(batch, trainer.SEQ_LEN)


def pipe(schedule: str, microbatches: int, virtual: int = 1) -> Pipeline:
    return Pipeline(schedule, microbatches, virtual, llama.logits_loss)


@functools.cache
def reference(n_layers: int) -> tuple:
    """The 1-device run of the tiny model with `n_layers`: (losses, final params, init state)."""
    if n_layers == trainer.tiny_config().n_layers:  # the session's shared program and init
        (prog, step), initial = trainer.compiled("dp=1"), trainer.initial_state()
    else:
        prog = trainer.program(trainer.layout("dp=1"), n_layers=n_layers)
        initial, step = jax.device_get(tuple(prog.init())), compile_step(prog)
    losses, params = trainer.train_losses(prog, trainer.STEPS, initial, step)
    return losses, params, initial


# --- tick tables (pure Python) ------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_tables_hold_their_invariants_and_1f1b_memory_is_flat_in_m(stages):
    for m in (stages, 2 * stages, 4 * stages, 4 * stages + 1):
        gpipe, one_f = schedules.build("gpipe", stages, m), schedules.build("1f1b", stages, m)
        schedules.build("gpipe", stages, m, backward=False)  # `build` runs `check` on each
        assert gpipe.stash_slots == m  # GPipe holds every micro-batch's input
        assert one_f.stash_slots == min(m, 2 * stages - 1)  # 1F1B: at most 2p-1, any M
        f_mb, b_mb = one_f.column("f_mb"), one_f.column("b_mb")
        # docs/strategies/pipeline.md's 1F1B: F(m, s) = m + s, B(m, s) = m + 2(S-1) - s
        for s in range(stages):
            assert list(f_mb[s : s + m, s]) == list(range(m))
            start = 2 * (stages - 1) - s
            assert list(b_mb[start : start + m, s]) == list(range(m))
        for virtual in (2, 3):
            if m % stages == 0:
                inter = schedules.build("interleaved", stages, m, virtual)
                assert inter.stash_slots <= 4 * stages * virtual


def test_check_catches_a_table_that_reads_a_slot_too_early():
    table = schedules.build("1f1b", 2, 4)
    cells = table.cells.copy()
    t = int(np.argmax(cells[:, 1, schedules.COLUMN["f_chunk"]] >= 0))
    cells[t, 1, schedules.COLUMN["f_mb"]] = 1  # stage 1 runs micro-batch 1 before it arrives
    with pytest.raises(AssertionError):
        schedules.check(schedules.Table(**{**table.__dict__, "cells": cells}))


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_interleaved_idles_less_than_gpipe_and_figures_match_theory(stages, microbatches):
    gpipe = schedules.build("gpipe", stages, microbatches)
    one_f = schedules.build("1f1b", stages, microbatches)
    inter = schedules.build("interleaved", stages, microbatches, 2)
    theory = (stages - 1) / (microbatches + stages - 1)
    assert gpipe.idle_fraction() == pytest.approx(theory)  # idle slots are skipped
    assert one_f.idle_fraction() == pytest.approx(theory)
    assert inter.idle_fraction() < gpipe.idle_fraction()
    assert inter.summary()["bubble_theory"] == pytest.approx(theory / 2)
    assert [(p.forward, p.backward) for p in one_f.phases()] == [
        (True, False),
        (True, True),
        (False, True),
    ]


# --- user errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pipeline,n_layers,batch,message",
    [
        (pipe("interleaved", 4, 2), 6, 16, "--n-layers 6 does not split into pp 2 x pp-virtual 2"),
        (pipe("1f1b", 1), 4, 16, "--microbatches 1 is fewer than the 2 pipeline stages"),
        (pipe("interleaved", 5, 2), 4, 10, "--microbatches 5 is not a multiple of the 2"),
        (pipe("gpipe", 4), 4, 10, "--batch 10 is not divisible by data-parallel size 1"),
        (pipe("gpipe", 4, 2), 4, 16, "--pp-virtual 2 applies only to --pp-schedule interleaved"),
        (pipe("interleaved", 4, 1), 4, 16, "interleaved schedule needs at least 2 chunks"),
        (pipe("zigzag", 4), 4, 16, "--pp-schedule 'zigzag' is not one of gpipe, 1f1b"),
    ],
)
def test_bad_settings_are_usage_errors(pipeline, n_layers, batch, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        check(pipeline, trainer.layout("pp=2"), n_layers, batch, accum=1)


def test_cli_exits_2_on_an_impossible_schedule():
    result = train_in_process(
        "--model", "tiny", "--mesh", "pp=4", "--pp-schedule", "1f1b",
        "--microbatches", "2",
    )  # fmt: skip
    assert result.returncode == 2
    assert "--microbatches 2 is fewer than the 4 pipeline stages" in result.stderr
    assert "Traceback" not in result.stderr


# --- parity with one device ------------------------------------------------------------------
# Each case of the schedule x stages x micro-batches grid runs on 8 devices where it can, with
# the other devices on dp, fsdp (ZeRO 1, 2, 3) or tp, so the grid is also the composition test.
# The pure pp=2 gpipe and 1f1b M=4 programs are also the memory test's M=4 points.

GRID = [
    # schedule, stages, micro-batches, mesh, zero
    ("gpipe", 2, 4, "pp=2", 3),
    ("1f1b", 2, 4, "pp=2", 3),
    ("interleaved", 2, 4, "fsdp=4,pp=2", 3),
    ("gpipe", 2, 8, "fsdp=2,pp=2,tp=2", 1),
    ("1f1b", 2, 8, "fsdp=2,pp=2,tp=2", 2),
    ("interleaved", 2, 8, "dp=2,pp=2,tp=2", 3),
    ("gpipe", 4, 4, "pp=4,tp=2", 3),
    ("1f1b", 4, 4, "dp=2,pp=4", 3),
    ("interleaved", 4, 4, "fsdp=2,pp=4", 3),
    ("gpipe", 4, 8, "pp=4", 3),
    ("1f1b", 4, 8, "pp=4,tp=2", 3),
    ("interleaved", 4, 8, "dp=2,pp=4", 3),
]


def n_layers_for(schedule: str, stages: int) -> int:
    return 2 * stages if schedule == "interleaved" else 4  # 8 layers for pp=4 x v=2


@functools.cache
def compiled_step(mesh: str, zero: int, schedule: str, microbatches: int, batch: int) -> tuple:
    """(program, AOT-compiled train step) of the tiny model pipelined on `mesh`."""
    stages = trainer.layout(mesh).mesh.shape["pipeline"]
    virtual = 2 if schedule == "interleaved" else 1
    prog = trainer.program(
        trainer.layout(mesh, zero),
        pipeline=pipe(schedule, microbatches, virtual),
        n_layers=n_layers_for(schedule, stages),
    )
    return prog, compile_step(prog, batch)


@pytest.mark.parametrize("schedule,stages,microbatches,mesh,zero", GRID)
def test_every_schedule_matches_one_device(schedule, stages, microbatches, mesh, zero):
    ref_losses, _, initial = reference(n_layers_for(schedule, stages))
    prog, step = compiled_step(mesh, zero, schedule, microbatches, trainer.BATCH)
    assert prog.layout.mesh.shape["pipeline"] == stages
    losses, _ = trainer.train_losses(prog, GRID_STEPS, initial, step)
    assert trainer.max_relative_difference(losses, ref_losses[:GRID_STEPS]) <= 1e-4


def test_3d_dp2_pp2_tp2_matches_one_device_for_20_steps_and_in_eval():
    ref_losses, ref_params, initial = reference(4)
    prog = trainer.program(trainer.layout("dp=2,pp=2,tp=2"), pipeline=pipe("1f1b", 4))
    losses, params = trainer.train_losses(prog, trainer.STEPS, initial, compile_step(prog))
    assert trainer.max_relative_difference(losses, ref_losses) <= 1e-4
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it trains, so parity is not trivial
    for leaf, ref_leaf in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-3, atol=2e-5)
    # The eval step runs the forward-only table; step 0's loss is the initial params' loss.
    win = trainer.windows()
    ids = data.train_window_ids(0, 0, trainer.BATCH, win.n_train)
    batch = data.global_batch(win, ids, prog.layout.batch_sharding())
    params0 = jax.device_put(initial[0], jax.tree.map(lambda a: a.sharding, prog.abstract_params))
    eval_step = prog.eval_step.lower(prog.abstract_params, batch).compile()
    eval_loss = float(eval_step(params0, batch))
    assert abs(eval_loss - ref_losses[0]) <= 1e-4 * ref_losses[0]


def test_accumulation_runs_inside_the_schedule_and_matches_one_device():
    # accum 2 x M 4 is one 1F1B pass over 8 micro-batches: one gradient reduction per step.
    ref_losses, _, initial = reference(4)
    prog = trainer.program(trainer.layout("dp=2,pp=2"), accum=2, pipeline=pipe("1f1b", 4))
    losses, _ = trainer.train_losses(prog, GRID_STEPS, initial, compile_step(prog))
    assert trainer.max_relative_difference(losses, ref_losses[:GRID_STEPS]) <= 1e-4


@pytest.mark.parametrize(
    "schedule,mesh,zero,accum",
    [("gpipe", "fsdp=4,pp=2", 2, 1), ("1f1b", "dp=2,pp=2,tp=2", 3, 1),
     ("1f1b", "fsdp=2,pp=2,tp=2", 3, 2)],
)  # fmt: skip
def test_explicit_executor_runs_the_schedule_with_hand_written_collectives(
    schedule, mesh, zero, accum
):
    # The whole step is one shard_map manual over every axis: the schedule's ppermutes over
    # `pipeline`, ZeRO's gathers and scatters over fsdp and Megatron's psums over tensor are
    # all written by hand, inside the same tick loop.
    ref_losses, _, initial = reference(4)
    prog = trainer.program(
        trainer.layout(mesh, zero), accum=accum, executor="explicit", pipeline=pipe(schedule, 4)
    )
    step = compile_step(prog)
    losses, _ = trainer.train_losses(prog, GRID_STEPS, initial, step)
    assert trainer.max_relative_difference(losses, ref_losses[:GRID_STEPS]) <= 1e-4
    if mesh == "dp=2,pp=2,tp=2":  # Megatron's all-reduces: every tick over one chunk
        summary = schedules.build(schedule, 2, 4).summary()
        shape = trainer.tiny_config().shape()
        want = theory.collectives(prog, shape, trainer.BATCH, trainer.SEQ_LEN, summary)
        got = hlo.collective_summary(hlo.collectives(step, prog.layout.mesh))
        assert got["all-reduce"]["bytes"] == pytest.approx(want["all-reduce"]["bytes"], rel=0.03)


@pytest.mark.parametrize(
    "executor,precision_name,message",
    [
        ("explicit", "fp32", "--collectives explicit runs --pp-schedule gpipe and 1f1b, not"),
        ("auto", "fp16", "--precision fp16 needs loss scaling, which pipelines"),
    ],
)
def test_what_pipelines_do_not_compose_with_is_refused_up_front(executor, precision_name, message):
    from spmd.engine import precision
    from spmd.engine.step import build_program

    with pytest.raises(UsageError, match=message):
        build_program(
            lambda seed: llama.create(trainer.tiny_config(), seed),
            llama.lm_loss,
            optax.sgd(0.1),
            trainer.layout("pp=2"),
            policy=precision.get(precision_name),
            executor=executor,
            pipeline=pipe("interleaved", 4, 2) if executor == "explicit" else pipe("gpipe", 4),
        )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_compiled_activation_sends_match_the_schedule(schedule):
    from spmd.estimate import theory

    prog, step = compiled_step("pp=2", 3, schedule, 4, trainer.BATCH)
    sends = hlo.collective_summary(hlo.collectives(step, prog.layout.mesh))["collective-permute"]
    summary = schedules.build(schedule, 2, 4).summary()
    shape = trainer.tiny_config().shape()
    want = theory.pipeline_sends(prog, shape, summary, trainer.BATCH, trainer.SEQ_LEN)
    assert (sends["count"], sends["bytes"]) == (want["count"], want["bytes"])


def test_gradients_cross_the_data_axis_once_per_step_not_once_per_micro_batch():
    # The auto executor's pipeline is manual over `data` too, so the gradient accumulators are
    # per-shard partial sums, all-reduced once after the tick loop (before: after every
    # micro-batch's backward slot, 8.6x the gradient bytes at dp=4,pp=2, M=4).
    prog, step = compiled_step("dp=2,pp=4", 3, "1f1b", 4, trainer.BATCH)
    over_data = [c for c in hlo.collectives(step, prog.layout.mesh) if c.axes == ("data",)]
    # Each device's gradient is its stage's blocks plus the embedding and head, in fp32: the
    # bytes of the params it holds.
    grad_bytes = state_bytes_per_device(step, prog)["params"]
    assert {c.kind for c in over_data} == {"all-reduce"}
    assert sum(c.bytes * c.count for c in over_data) == pytest.approx(grad_bytes, rel=0.01)


# --- memory ----------------------------------------------------------------------------------


def test_1f1b_temp_memory_is_flat_in_microbatches_while_gpipe_grows():
    rows = trainer.BATCH // 4  # per micro-batch, fixed: M=4 is the grid's program, M=16 new
    temp = {
        (schedule, m): hlo.memory(compiled_step("pp=2", 3, schedule, m, m * rows)[1])["temp"]
        for schedule in ("1f1b", "gpipe")
        for m in (4, 16)
    }
    activation = rows * trainer.SEQ_LEN * trainer.tiny_config().embed_dim * 4  # one [b, T, E]
    # GPipe keeps 12 more micro-batches' chunk inputs and output gradients; 1F1B keeps
    # 2p - 1 = 3 inputs either way (what still grows is the [M, rows, length] token ids).
    assert temp["gpipe", 16] - temp["gpipe", 4] >= 12 * activation
    assert temp["1f1b", 16] - temp["1f1b", 4] <= 2 * activation
    assert temp["1f1b", 16] < temp["gpipe", 16]


# --- command line: the schedule's report, printed and in the metrics' config record ----------


def test_cli_trains_interleaved_and_records_the_schedule(tmp_path):
    corpus, metrics = tmp_path / "corpus.txt", tmp_path / "m.jsonl"
    corpus.write_bytes(bytes(trainer.windows().tokens[:100_000].astype(np.uint8)))
    result = train_in_process(
        "--model", "tiny", "--mesh", "pp=2", "--pp-schedule", "interleaved",
        "--pp-virtual", "2", "--microbatches", "4", "--batch", "8", "--seq-len", "32",
        "--steps", "2", "--log-every", "1", "--eval-fraction", "0",
        "--data", str(corpus), "--metrics", str(metrics),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "pipeline: interleaved over 2 stages x 2 chunks, 4 micro-batches" in result.stdout
    lines = records(metrics)
    report = lines[0]["pipeline"]
    assert report["bubble_theory"] == pytest.approx(1 / 5 / 2)
    assert report["idle_fraction"] == pytest.approx(1 / 9)
    losses = [r["loss"] for r in lines if r["kind"] == "train"]  # eval: the 3-D test
    assert len(losses) == 2 and np.all(np.isfinite(losses))
