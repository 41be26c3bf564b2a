"""Context parallelism (`cp=` mesh axis): every activation's length split over `context`,
attention as a load-balanced causal ring (spmd.parallel.ring_attention). One compiled program
per layout, shared by the tests here:

- fp32 20-step loss and final-params parity with one device: cp=2 and dp=2,cp=2,tp=2 (with
  sequence parallelism) under `explicit`, cp=4 under `auto` at length 256;
- the explicit steps' collective-permutes are theory's: cp−1 key and value blocks per layer
  in the forward, as many gradients back; the gradient all-reduce spans `context`;
- compiled temp memory per device at cp=4 ≤ 0.5 x cp=1 (the same length-256 programs), and
  the planner's activations shrink alike (±15%); the cp=4 auto step gathers no sequence;
- with a pipeline (pp=2): 20-step loss and final-params parity of cp=2 under both executors
  (auto 1F1B, explicit GPipe; the auto one's forward-only eval step too), and 5 steps of
  cp=2,pp=2,tp=2 with sequence parallelism (explicit 1F1B, auto interleaved); the explicit
  step's collective-permutes are the schedule's sends plus the ring's, as theory counts them;
- the ring's order and the flags' checks.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from models import llama
from spmd.errors import UsageError
from spmd.estimate import cost, hlo, memory, theory
from spmd.io import data
from spmd.parallel import schedules
from spmd.parallel.mesh import MESH_AXES
from spmd.parallel.pipeline import Pipeline
from spmd.parallel.ring_attention import balanced_order
from spmd.run.checks import check_sequence_split
from tests import trainer

BATCH, SEQ = trainer.BATCH, trainer.SEQ_LEN
LAYOUTS = [  # (mesh, executor, sequence parallel)
    ("cp=2", "explicit", False),
    ("dp=2,cp=2,tp=2", "explicit", True),
]
# cp=4 runs where attention dominates the activations: length 256, 8 heads (8 x 256
# probabilities per token against about 600 other floats); its program serves parity too.
LONG_BATCH, LONG_SEQ = 1, 256


@functools.cache
def compiled(
    mesh: str, executor: str, sequence_parallel: bool = False, batch: int = BATCH, seq: int = SEQ
):
    lay = dataclasses.replace(trainer.layout(mesh), sequence_parallel=sequence_parallel)
    prog = trainer.program(lay, 1, executor)
    return prog, prog.compile_train_step(batch, seq)


def long_losses(mesh: str) -> tuple[np.ndarray, dict]:
    """20 steps of the tiny model on LONG_BATCH x LONG_SEQ batches (auto executor)."""
    prog, step = compiled(mesh, "auto", False, LONG_BATCH, LONG_SEQ)
    state = jax.tree.map(
        lambda x, target: jax.device_put(x, target.sharding),
        tuple(trainer.initial_state()),
        (prog.abstract_params, prog.abstract_opt_state, prog.abstract_loss_scale),
    )
    win, losses = trainer.windows(LONG_SEQ), []
    for i in range(trainer.STEPS):
        ids = data.train_window_ids(0, i, LONG_BATCH, win.n_train)
        *state, metrics = step(*state, data.global_batch(win, ids, prog.layout.batch_sharding()))
        losses.append(metrics["loss"])
    return np.asarray(jax.device_get(losses)), jax.device_get(state[0])


def test_balanced_order_gives_device_i_chunks_i_and_its_mirror():
    order = balanced_order(16, 4).reshape(4, 2, 2)  # 4 devices x 2 chunks of 2 tokens
    assert order[0].tolist() == [[0, 1], [14, 15]]
    assert order[3].tolist() == [[6, 7], [8, 9]]
    assert sorted(balanced_order(48, 3).tolist()) == list(range(48))


def _program_and_step(layout: tuple) -> tuple:
    prog, step = compiled(*layout)
    return prog, trainer.STEPS, trainer.initial_state(), step


def assert_matches(layout: object, run: tuple, ref: tuple) -> None:
    """Losses within 1e-4 relative of the reference's first steps; final params close after
    the full 20 steps."""
    (losses, params), (ref_losses, ref_params) = run, ref
    assert trainer.max_relative_difference(losses, ref_losses[: len(losses)]) <= 1e-4, layout
    if len(losses) < trainer.STEPS:
        return
    assert ref_losses[-1] < ref_losses[0] - 0.3, layout
    for leaf, ref_leaf in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-3, atol=2e-5)


def test_loss_and_params_match_one_device():
    ref = trainer.losses("dp=1")
    runs = [(layout, trainer.train_losses(*_program_and_step(layout)), ref) for layout in LAYOUTS]
    runs.append(("cp=4", long_losses("cp=4"), long_losses("dp=1")))
    for layout, run, ref_run in runs:
        assert_matches(layout, run, ref_run)


# --- with a pipeline ------------------------------------------------------------------------
# The ring's ppermutes run inside the schedule's slots; each stage runs its slots in lockstep
# with the others (spmd.parallel.pipeline_stage.tick_fn), else XLA:CPU pairs one stage's ring
# sends with another stage's pipeline sends.
PIPELINED = [  # (mesh, executor, schedule, sequence parallel, steps)
    ("cp=2,pp=2", "auto", "1f1b", False, trainer.STEPS),
    ("cp=2,pp=2", "explicit", "gpipe", False, trainer.STEPS),
    ("cp=2,pp=2,tp=2", "explicit", "1f1b", True, 5),
    ("cp=2,pp=2,tp=2", "auto", "interleaved", True, 5),
]


@functools.cache
def pipelined(mesh: str, executor: str, schedule: str, sequence_parallel: bool):
    """(program, AOT-compiled train step) of the tiny model pipelined with M=4."""
    lay = dataclasses.replace(trainer.layout(mesh), sequence_parallel=sequence_parallel)
    pipe = Pipeline(schedule, 4, 2 if schedule == "interleaved" else 1, llama.logits_loss)
    prog = trainer.program(lay, 1, executor, pipeline=pipe)
    return prog, prog.compile_train_step(BATCH, SEQ)


@pytest.mark.parametrize("case", PIPELINED, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_pipelined_context_and_sequence_parallel_match_one_device(case):
    *layout, steps = case
    prog, step = pipelined(*layout)
    run = trainer.train_losses(prog, steps, trainer.initial_state(), step)
    assert_matches(case, run, trainer.losses("dp=1"))
    if layout[1] == "auto" and steps == trainer.STEPS:  # the forward-only table: eval
        win = trainer.windows()
        ids = data.train_window_ids(0, 0, BATCH, win.n_train)
        batch = data.global_batch(win, ids, prog.layout.batch_sharding())
        params = jax.device_put(
            trainer.initial_state()[0], jax.tree.map(lambda a: a.sharding, prog.abstract_params)
        )
        first = trainer.losses("dp=1")[0][0]
        assert abs(float(prog.eval_step(params, batch)) - first) <= 1e-4 * first


@pytest.mark.parametrize("layout", LAYOUTS)
def test_explicit_ring_sends_match_theory(layout):
    prog, step = compiled(*layout)
    colls = hlo.collectives(step, prog.layout.mesh)
    measured = hlo.collective_summary(colls)
    shape = trainer.tiny_config().shape()
    expected = theory.collectives(prog, shape, BATCH, SEQ)
    assert set(measured) == set(expected)
    for kind, want in expected.items():
        assert measured[kind]["bytes"] == pytest.approx(want["bytes"], rel=0.01), kind
        assert measured[kind]["count"] <= want["count"], kind
    permutes = [c for c in colls if c.kind == "collective-permute"]
    assert {c.axes for c in permutes} == {("context",)}
    cp, n_layers = prog.layout.mesh.shape["context"], trainer.tiny_config().n_layers
    # forward: cp-1 key blocks and cp-1 value blocks per layer; backward: their gradients
    block = permutes[0].bytes  # one key (or value) block [rows, SEQ/cp, kv_heads, head_dim]
    assert sum(c.bytes * c.count for c in permutes) == 4 * (cp - 1) * n_layers * block
    grads = max((c for c in colls if c.kind == "all-reduce"), key=lambda c: c.bytes)
    assert "context" in grads.axes  # the params' gradients are averaged over context too


@pytest.mark.parametrize("case", [c for c in PIPELINED if c[1] == "explicit"], ids=str)
def test_pipelined_ring_sends_match_theory(case):
    prog, step = pipelined(*case[:4])
    permutes = hlo.collective_summary(hlo.collectives(step, prog.layout.mesh))
    summary = schedules.build(case[2], 2, 4).summary()
    shape = trainer.tiny_config().shape()
    stage = theory.pipeline_sends(prog, shape, summary, BATCH, SEQ)
    ring = theory.pipelined_ring_sends(prog, shape, summary, BATCH, SEQ)
    assert ring["count"] > 0
    want = stage["bytes"] + ring["bytes"]
    assert permutes["collective-permute"]["bytes"] == pytest.approx(want, rel=0.01)


def test_auto_cp4_splits_the_matmuls_rows_instead_of_gathering_the_sequence():
    """Under the auto executor a matmul keeps batch and the split length apart
    (models/matmul.py): merged into one rows dim, XLA's partitioner gathered the whole
    sequence for every projection (tiny, cp=4, batch 16 x 32: 46 all-gathers, 10.1 MiB per
    step). Now the step holds theory's ring sends and no all-gather."""
    prog, step = compiled("cp=4", "auto")  # batch 16: rows would merge it with the length
    measured = hlo.collective_summary(hlo.collectives(step, prog.layout.mesh))
    assert "all-gather" not in measured
    expected = theory.collectives(prog, trainer.tiny_config().shape(), BATCH, SEQ)
    sends = measured["collective-permute"]["bytes"]
    assert sends == pytest.approx(expected["collective-permute"]["bytes"], rel=0.01)


def test_temp_memory_at_cp4_is_at_most_half_of_one_device_as_the_planner_predicts():
    one, cp4 = (compiled(m, "auto", False, LONG_BATCH, LONG_SEQ)[1] for m in ("dp=1", "cp=4"))
    temps = [hlo.memory(c)["temp"] for c in (one, cp4)]
    # 1/cp of the token-linear activations plus the ring's per-step buffers: 12.05 -> 5.53 MB,
    # 0.458 (15.20 -> 6.31 MB, 0.415, before the SwiGLU's silu was recomputed, which shrinks
    # the activations but not the ring's buffers); neither side keeps attention probabilities,
    # which the backward pass recomputes
    assert temps[1] <= 0.5 * temps[0], temps
    # the planner's activations (spmd.estimate.memory) shrink as the compiled temp does
    cfg, axes = trainer.tiny_config(), dict.fromkeys(MESH_AXES, 1)
    planned = [
        memory.activation_bytes(
            cost.Setup(
                cfg.shape(),
                cfg.n_params(),
                {**axes, "context": cp},
                1,
                "fp32",
                "adamw",
                LONG_BATCH,
                LONG_SEQ,
            )  # fmt: skip
        )
        for cp in (1, 4)
    ]
    assert planned[1] / planned[0] == pytest.approx(temps[1] / temps[0], rel=0.15)


def test_bad_context_flags_name_the_value():
    with pytest.raises(UsageError, match="--seq-len 36 must be a multiple of 2 x cp = 8"):
        check_sequence_split(36, {"context": 4}, False)
    check_sequence_split(64, {"context": 2, "pipeline": 2, "tensor": 2}, True)
    check_sequence_split(64, {"context": 4, "tensor": 2}, True)
    check_sequence_split(64, {"context": 2}, False, moe=True)  # dropless MoE composes with cp
    with pytest.raises(UsageError, match="MoE model"):
        check_sequence_split(64, {"tensor": 2}, True, moe=True)
    with pytest.raises(UsageError, match="--accum 2 with cp > 1 needs --collectives explicit"):
        trainer.program(trainer.layout("dp=2,cp=2"), 2, "auto")
