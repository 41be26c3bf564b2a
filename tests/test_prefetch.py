"""ZeRO-3's prefetching layer scan (explicit executor, spmd.parallel.layer_scan): the same losses
as gathering each layer's params inside its own iteration, each layer's all-gathers issued one
iteration ahead of the layer that uses them (in the program spmd emits and in the compiled
loops), the gather count theory gives, and no more activation memory per layer.

Prefetch runs where the layers are rematerialised (hooks.scan_layers), so these programs set
a remat policy; the shared remat-none programs of test_parity gather in place."""

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from spmd.estimate import hlo, hlo_text, theory
from spmd.parallel import hooks
from tests import trainer

LAYOUTS = [("fsdp=8", "dots_saveable"), ("dp=2,fsdp=2,tp=2", "full")]  # (mesh, remat)
GATHER = "all-gather"


@functools.cache
def _compiled(mesh: str, remat: str, prefetch: bool) -> tuple:
    """(program, compiled step) of the tiny model under explicit ZeRO-3, made once."""
    program = trainer.program(
        trainer.layout(mesh), executor="explicit", prefetch=prefetch, remat=remat
    )
    return program, program.compile_train_step(trainer.BATCH, trainer.SEQ_LEN)


@pytest.mark.parametrize("mesh,remat", LAYOUTS)
def test_prefetch_trains_like_gathering_in_place(mesh, remat):
    runs = {}
    for prefetch in (True, False):
        program, step = _compiled(mesh, remat, prefetch)
        runs[prefetch] = trainer.train_losses(program, trainer.STEPS, trainer.initial_state(), step)
    (on, params_on), (off, params_off) = runs[True], runs[False]
    assert trainer.max_relative_difference(on, off) <= 1e-6
    for a, b in zip(jax.tree.leaves(params_on), jax.tree.leaves(params_off), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _flat_primitives(jaxpr, bodies: list) -> list[str]:
    """The primitive names of `jaxpr` in program order, sub-jaxprs inlined where they are
    called, except scan bodies: each of those is appended to `bodies` as its own sequence."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            bodies.append(_flat_primitives(eqn.params["jaxpr"].jaxpr, bodies))
            continue
        names.append(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, list | tuple) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names += _flat_primitives(inner, bodies)
    return names


def _layer_loops(prefetch: bool) -> list[list[str]]:
    """The scan bodies of the fsdp=8 ZeRO-3 train step that gather params and multiply."""
    program, _ = _compiled(*LAYOUTS[0], prefetch)
    traced = program.train_step.trace(
        program.abstract_params,
        program.abstract_opt_state,
        program.abstract_loss_scale,
        program.abstract_batch(trainer.BATCH, trainer.SEQ_LEN),
    )
    bodies: list[list[str]] = []
    _flat_primitives(traced.jaxpr.jaxpr, bodies)
    return [b for b in bodies if "all_gather" in b and "dot_general" in b]


def test_each_layer_loop_issues_its_gathers_before_its_matmuls():
    loops = _layer_loops(prefetch=True)
    assert len(loops) == 2  # forward and backward
    for body in loops:
        last_gather = max(i for i, name in enumerate(body) if name == "all_gather")
        assert last_gather < body.index("dot_general")
    # Without prefetch the forward loop gathers each param right before its own matmul (the
    # backward's remat replays the gathers first, but of the layer it is differentiating:
    # test_compiled_loops_only_carry_the_gathered_params_to_the_next_layer tells them apart).
    interleaved = [
        max(i for i, name in enumerate(body) if name == "all_gather") > body.index("dot_general")
        for body in _layer_loops(prefetch=False)
    ]
    assert any(interleaved)


# Ops that pass a value on unchanged, on its way to the loop's next iteration.
_PASS_ON = {"bitcast", "copy", "reshape", "tuple", "get-tuple-element", "all-gather-done"}


def _gathers_used_in_their_iteration(compiled) -> list[bool]:
    """For each all-gather inside a compiled loop: whether anything in the same iteration
    computes with its result (rather than only passing it to the next iteration)."""
    comps, entry = hlo_text.parse_computations(compiled.as_text())
    trips = hlo_text.multipliers(comps, entry)
    out = []
    for comp, instrs in comps.items():
        if trips.get(comp, 1) <= 1:
            continue
        users: dict[str, list[tuple[str, str]]] = {}
        for name, _, opcode, attrs in instrs:
            for operand in re.findall(r"%([\w.\-]+)", attrs):
                users.setdefault(operand, []).append((name, opcode))
        for name, _, opcode, _ in instrs:
            if opcode not in (GATHER, "all-gather-start"):
                continue
            pending, used = [name], False
            while pending:
                for user, user_op in users.get(pending.pop(), []):
                    if user_op in _PASS_ON:
                        pending.append(user)
                    else:
                        used = True
            out.append(used)
    return out


def test_compiled_loops_only_carry_the_gathered_params_to_the_next_layer():
    _, compiled = _compiled(*LAYOUTS[0], True)
    used = _gathers_used_in_their_iteration(compiled)
    assert used and not any(used)
    _, in_place = _compiled(*LAYOUTS[0], False)
    used = _gathers_used_in_their_iteration(in_place)
    assert used and all(used)


@pytest.mark.parametrize("prefetch", [True, False])
def test_layer_gathers_equal_theory(prefetch):
    program, compiled = _compiled(*LAYOUTS[0], prefetch)
    measured = hlo.collective_summary(hlo.collectives(compiled, program.layout.mesh))[GATHER]
    model = dataclasses.replace(trainer.tiny_config(), remat=LAYOUTS[0][1])
    shape = model.shape()
    expected = theory.collectives(program, shape, trainer.BATCH, trainer.SEQ_LEN)[GATHER]
    assert (measured["count"], measured["bytes"]) == (expected["count"], expected["bytes"])
    per_layer = len(jax.tree.leaves(program.abstract_params["blocks"]))
    outside = len(jax.tree.leaves(program.abstract_params)) - per_layer  # embed, norm, head
    passes = 2 * model.n_layers + (1 if prefetch else 0)  # a spare gather per pass, one kept
    assert measured["count"] == per_layer * passes + outside


def test_without_remat_the_layers_gather_in_place():
    # --remat none keeps every activation: there the prefetching scan would keep more of them
    # per layer than XLA's scan, so hooks.scan_layers leaves prefetch off and says so.
    program = trainer.program(trainer.layout("fsdp=8"), executor="explicit", prefetch=True)
    compiled = program.compile_train_step(trainer.BATCH, trainer.SEQ_LEN)
    assert hooks.notes()["layer_scan"] == "prefetch off: --remat none"
    measured = hlo.collective_summary(hlo.collectives(compiled, program.layout.mesh))[GATHER]
    shape = trainer.tiny_config().shape()
    expected = theory.collectives(program, shape, trainer.BATCH, trainer.SEQ_LEN)[GATHER]
    assert measured["count"] == expected["count"] == 9 * 2 * 4 + 3


def test_prefetch_costs_no_activation_memory_per_layer():
    # Long enough that attention-sized residuals dominate (what an extra residual per layer
    # would show), deep enough to tell per-layer growth from a constant.
    temps = {}
    for prefetch in (True, False):
        for layers in (2, 6):
            program = trainer.program(
                trainer.layout("fsdp=8"),
                executor="explicit",
                prefetch=prefetch,
                remat="dots_saveable",
                n_layers=layers,
            )
            temps[prefetch, layers] = hlo.memory(program.compile_train_step(8, 256))["temp"]
    layer = theory.gathered_layer_bytes(program)
    per_layer = {p: (temps[p, 6] - temps[p, 2]) / 4 for p in (True, False)}
    assert per_layer[True] <= per_layer[False] + layer  # activations as without prefetch
    assert temps[True, 6] <= temps[False, 6] + 3 * layer  # + at most 3 layers whole


def test_bench_collectives_times_prefetch_off_and_on(capsys):
    from spmd import bench_collectives

    argv = ["--compare-prefetch", "--remat", "full", "--layouts", "zero3,ddp", "--steps", "1"]
    assert bench_collectives.main([*argv, "--batch", "8", "--seq-len", "16"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    (zero3,) = [row for row in rows if row[0] == "zero3"]  # ddp gathers no layer: left out
    # tiny's 4 layers of 9 params gathered 2L times, or 2L + 1 with prefetch; + 3 outside
    assert re.findall(r"/ (\d+)", " ".join(zero3)) == [str(9 * 8 + 3), str(9 * 9 + 3)]


def test_a_layer_closing_over_a_traced_float_is_told_apart():
    # Such a layer runs in the plain scan: prefetch's custom_vjp could not differentiate the
    # closed-over value. Integer closures (positions, document ids) do not count.
    from spmd.parallel import layer_scan

    stacked = {"w": jax.numpy.ones((3, 4))}
    seen = {}

    def loss(outer, positions):
        def float_layer(carry, state):
            return carry * state["w"] * outer, None

        def int_layer(carry, state):
            return carry * state["w"] * positions, None

        carry = jax.numpy.ones(4)
        seen["float"] = layer_scan.closes_over_a_float(float_layer, carry, stacked)
        seen["int"] = layer_scan.closes_over_a_float(int_layer, carry, stacked)
        return outer

    jax.jit(jax.grad(loss))(1.0, jax.numpy.arange(4))
    assert seen == {"float": True, "int": False}
