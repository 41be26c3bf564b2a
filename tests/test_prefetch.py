"""ZeRO-3's prefetching layer scan (explicit executor, spmd.parallel.layer_scan): the same losses
as gathering each layer's params inside its own iteration, each layer's all-gathers issued one
iteration ahead of the layer that uses them (in the program spmd emits and in the compiled
loops), the gather count theory gives, and memory that still holds a few layers whole, not all.

The prefetching programs are the default explicit ZeRO-3 ones that test_parity and
test_explicit compile too (trainer.compiled / trainer.losses share them)."""

import re

import jax
import numpy as np
import pytest

from spmd.estimate import hlo, theory
from tests import trainer

LAYOUTS = [("fsdp=8", 3), ("dp=2,fsdp=2,tp=2", 3)]
GATHER = "all-gather"


@pytest.mark.parametrize("mesh,zero", LAYOUTS)
def test_prefetch_trains_like_gathering_in_place(mesh, zero):
    on, params_on = trainer.losses(mesh, zero, "explicit")
    off, params_off = trainer.losses(mesh, zero, "explicit", prefetch=False)
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
    program, _ = trainer.compiled("fsdp=8", 3, "explicit", prefetch=prefetch)
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
    comps, entry = hlo._parse_computations(compiled.as_text())
    trips = hlo._multipliers(comps, entry)
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
    _, compiled = trainer.compiled("fsdp=8", 3, "explicit")
    used = _gathers_used_in_their_iteration(compiled)
    assert used and not any(used)
    _, in_place = trainer.compiled("fsdp=8", 3, "explicit", prefetch=False)
    used = _gathers_used_in_their_iteration(in_place)
    assert used and all(used)


@pytest.mark.parametrize("prefetch", [True, False])
def test_layer_gathers_equal_theory(prefetch):
    program, compiled = trainer.compiled("fsdp=8", 3, "explicit", prefetch=prefetch)
    assert program.prefetch is prefetch
    measured = hlo.collective_summary(hlo.collectives(compiled, program.layout.mesh))[GATHER]
    shape = theory.shape_of(trainer.tiny_config(), np.float32)
    expected = theory.collectives(program, shape, trainer.BATCH, trainer.SEQ_LEN)[GATHER]
    assert (measured["count"], measured["bytes"]) == (expected["count"], expected["bytes"])
    layers = trainer.tiny_config().n_layers
    per_layer = len(jax.tree.leaves(program.abstract_params["blocks"]))
    outside = len(jax.tree.leaves(program.abstract_params)) - per_layer  # embed, norm, head
    passes = 2 * layers - 1 if prefetch else 2 * layers
    assert measured["count"] == per_layer * passes + outside


def test_prefetch_holds_a_few_layers_whole_not_all():
    # Deep and wide enough that keeping every layer whole would dominate the temp memory.
    temps = {}
    for prefetch in (True, False):
        for layers in (2, 6):
            program = trainer.program(
                trainer.layout("fsdp=8"),
                executor="explicit",
                prefetch=prefetch,
                mlp_dim=1024,
                n_layers=layers,
            )
            temps[prefetch, layers] = hlo.memory(program.compile_train_step(8, 8))["temp"]
    layer = theory.gathered_layer_bytes(program)
    assert (temps[True, 6] - temps[True, 2]) / 4 < layer  # more layers add activations only
    # the double buffer: the next layer whole beside the current one, and the last layer
    # kept whole from the forward into the backward pass
    assert temps[True, 6] - temps[False, 6] <= 3 * layer


def test_bench_collectives_times_prefetch_off_and_on(capsys):
    from spmd import bench_collectives

    argv = ["--prefetch", "--layouts", "zero3,ddp", "--steps", "1", "--batch", "8"]
    assert bench_collectives.main([*argv, "--seq-len", "16"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    (zero3,) = [row for row in rows if row[0] == "zero3"]  # ddp gathers no layer: left out
    # tiny: 4 layers of 9 params and 3 params outside them, gathered 2L or 2L - 1 times
    assert zero3[3:5] == ["/", str(9 * 8 + 3)] and zero3[6:8] == ["/", str(9 * 7 + 3)]
