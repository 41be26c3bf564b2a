"""The explicit executor (shard_map + hand-written collectives): the textbook collectives and
bytes of each layout, ZeRO-3's per-device memory, one gradient reduction per step under
accumulation. Loss parity with `auto` and one device is in test_parity.py and
test_accumulate.py; here only compiled steps are read, nothing is trained.

Compiles the tiny preset's step in-process on the 8 simulated CPU devices of conftest.py.
"""

import dataclasses

import jax
import numpy as np
import pytest

from models import llama
from spmd.engine.state_layout import state_bytes_per_device
from spmd.errors import UsageError
from spmd.estimate import dry_run_table, hlo, theory
from spmd.model_shape import ModelShape
from spmd.parallel import mesh
from spmd.run.config import resolve
from spmd.run.resolve import sections as run_sections
from spmd.train import main as train_main
from tests import trainer

BATCH, SEQ = trainer.BATCH, trainer.SEQ_LEN
TINY = trainer.tiny_config()
LAYOUTS = {  # the meshes/ presets on 8 devices; megatron's tp=8 > 4 kv heads replicates them
    "ddp": ("dp=8", 3),
    "zero1": ("fsdp=8", 1),
    "zero2": ("fsdp=8", 2),
    "zero3": ("fsdp=8", 3),
    "megatron": ("tp=8", 3),
    "3d": ("dp=2,fsdp=2,tp=2", 3),
}


def _program(mesh_text: str, zero: int, executor: str, accum: int = 1, **model_overrides):
    return trainer.program(trainer.layout(mesh_text, zero), accum, executor, **model_overrides)


def _compiled(mesh_text: str, zero: int, executor: str, accum: int = 1):
    """(program, compiled train step) of one layout and executor (shared with test_parity)."""
    return trainer.compiled(mesh_text, zero, executor, accum)


def _shape(model=TINY) -> ModelShape:
    return model.shape()


def _measured(compiled, program) -> dict:
    return hlo.collective_summary(hlo.collectives(compiled, program.layout.mesh))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_explicit_collectives_match_the_formula(name):
    program, compiled = _compiled(*LAYOUTS[name], "explicit")
    measured = _measured(compiled, program)
    expected = theory.collectives(program, _shape(), BATCH, SEQ)
    assert set(measured) == set(expected)
    for kind, want in expected.items():
        assert measured[kind]["bytes"] == pytest.approx(want["bytes"], rel=0.01), kind
        assert measured[kind]["count"] <= want["count"], kind  # XLA may fuse, never split


def test_explicit_collective_kinds_per_layout():
    P = 4 * TINY.n_params()  # fp32 param bytes
    kinds = {}
    for name, layout in LAYOUTS.items():
        program, compiled = _compiled(*layout, "explicit")
        colls = hlo.collectives(compiled, program.layout.mesh)
        kinds[name] = {(c.kind, c.axes) for c in colls if c.bytes > 64}  # scalars aside
        if name == "ddp":  # one fused all-reduce of every gradient (and the 4-byte loss)
            assert len(colls) == 1 and P <= colls[0].bytes <= P + 8
    assert kinds["ddp"] == {("all-reduce", ("data",))}
    assert kinds["zero1"] == {("all-reduce", ("fsdp",)), ("all-gather", ("fsdp",))}
    assert kinds["zero2"] == {("reduce-scatter", ("fsdp",)), ("all-gather", ("fsdp",))}
    assert kinds["zero3"] == {("reduce-scatter", ("fsdp",)), ("all-gather", ("fsdp",))}
    assert kinds["megatron"] == {("all-reduce", ("tensor",))}
    assert kinds["3d"] == {
        ("all-gather", ("fsdp",)),
        ("reduce-scatter", ("fsdp",)),
        ("all-reduce", ("tensor",)),
        ("all-reduce", ("data",)),
    }


def test_zero3_gathers_each_layer_once_per_pass():
    # remat none: each layer gathers inside its own iteration (test_prefetch.py: one ahead)
    program, compiled = _compiled(*LAYOUTS["zero3"], "explicit")
    colls = hlo.collectives(compiled, program.layout.mesh)
    per_layer = len(jax.tree.leaves(program.abstract_params["blocks"]))
    in_loop = [c for c in colls if c.count == TINY.n_layers]
    gathers = [c for c in in_loop if c.kind == "all-gather"]
    scatters = [c for c in in_loop if c.kind == "reduce-scatter"]
    assert len(gathers) == 2 * per_layer  # each layer's params: forward, and again in backward
    assert len(scatters) == per_layer  # each layer's grads: once, in the backward pass
    assert sum(c.bytes for c in gathers) == 2 * theory.gathered_layer_bytes(program)


def test_zero3_memory_is_a_shard_plus_one_gathered_layer():
    # Wide MLP, few tokens: a gathered layer outweighs a layer's activations, so keeping every
    # layer whole (what autodiff does unless the gathers are recomputed) would show.
    temps = {}
    for layers in (2, 6):
        deeper = dataclasses.replace(TINY, mlp_dim=1024, n_layers=layers)
        program = _program("fsdp=8", 3, "explicit", mlp_dim=1024, n_layers=layers)
        compiled = program.compile_train_step(8, 8)
        params = state_bytes_per_device(compiled, program)["params"]
        assert params == 4 * deeper.n_params() // 8  # fp32 params, split 8 ways
        temps[layers] = hlo.memory(compiled)["temp"]
        layer = theory.gathered_layer_bytes(program)
        assert temps[layers] >= layer  # one layer is whole while it computes
    assert (temps[6] - temps[2]) / 4 < layer  # but only one: each more layer adds less


def test_accumulation_reduces_gradients_once_per_step():
    # (Accumulation's loss parity, explicit included, is in test_accumulate.py.)
    program, compiled = _compiled("dp=2,fsdp=2,tp=2", 3, "explicit", 2)
    measured = _measured(compiled, program)
    for kind, want in theory.collectives(program, _shape(), BATCH, SEQ).items():
        assert measured[kind]["bytes"] == pytest.approx(want["bytes"], rel=0.01), kind
    colls = hlo.collectives(compiled, program.layout.mesh)
    over_data = [c for c in colls if c.axes == ("data",)]
    assert len(over_data) == 1 and over_data[0].count == 1  # one all-reduce of the grad shards
    # ZeRO-3 reduce-scatters each micro-batch's grads (its grads only exist as 1/N shards);
    # ZeRO-2 sums the micro-batches' local grads and reduce-scatters once.
    program = _program("fsdp=8", 2, "explicit", accum=2)
    colls = hlo.collectives(program.compile_train_step(BATCH, SEQ), program.layout.mesh)
    scatters = [c for c in colls if c.kind == "reduce-scatter"]
    assert len(scatters) == len(jax.tree.leaves(program.abstract_params))
    assert all(c.count == 1 for c in scatters)


def test_dry_run_report_sets_measured_beside_expected():
    program, compiled = _compiled(*LAYOUTS["zero2"], "explicit")
    report = dry_run_table.report(program, compiled, _shape(), BATCH, SEQ)
    rows = {line.split()[0]: line.split() for line in report.splitlines()}
    assert rows["reduce-scatter"][-2] == "1.000"  # ratio column, then the axes
    assert rows["argument"][-1] == "1.000"


def test_collectives_flag_and_bad_executor():
    sections = resolve(["--collectives", "explicit", "--model", "tiny"], run_sections(), "test")
    assert sections["parallel"].collectives == "explicit"
    with pytest.raises(UsageError, match="--collectives 'manual'"):
        _program("dp=8", 3, "manual")
    assert train_main(["--model", "tiny", "--collectives", "manual", "--dry-run"]) == 2


def test_explicit_step_keeps_the_auto_steps_shardings():
    # Checkpoints and the train loop see the same state whichever executor ran.
    for name in ("zero1", "3d"):
        _, auto = _compiled(*LAYOUTS[name], "auto")
        _, explicit = _compiled(*LAYOUTS[name], "explicit")
        assert explicit.input_shardings == auto.input_shardings
        assert explicit.output_shardings[:3] == auto.output_shardings[:3]


def test_cross_entropy_matches_optax_on_one_device():
    import optax

    logits = jax.random.normal(jax.random.key(0), (2, 5, 11)) * 3
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    np.testing.assert_allclose(llama.cross_entropy(logits, targets), want, rtol=1e-6)


def test_kv_heads_replicate_when_tensor_outnumbers_them():
    from spmd.parallel import rules

    tp8 = mesh.build_mesh(mesh.parse_mesh("tp=8"))
    table = rules.rules_for(3, "params")
    spec = rules.partition_spec(("embed", "kv_heads", "head_dim"), (64, 4, 8), table, tp8)
    assert spec == jax.sharding.PartitionSpec(None, None, None)
    spec = rules.partition_spec(("embed", "heads", "head_dim"), (64, 8, 8), table, tp8)
    assert spec == jax.sharding.PartitionSpec(None, "tensor", None)
    with pytest.raises(UsageError, match="kv_heads=3"):
        rules.partition_spec(("embed", "kv_heads", "head_dim"), (64, 3, 8), table, tp8)
