"""The planner under --cp-mode ulysses (spmd.estimate.comms.context_collectives, .memory,
.timing): Ulysses' 4 all-to-alls per layer and pass in place of the ring's collective-permutes,
the same figure as spmd.estimate.theory's (which the dry run checks against the compiled
step, x1.000), the one-device kernel's scores and Ulysses' gathered heads in the activations,
and heads that cp does not split refused with exit 2 and one line."""

import dataclasses
import types

import jax.numpy as jnp
import pytest

from spmd import plan
from spmd.errors import UsageError
from spmd.estimate import comms, context_theory, cost, long_sequence, memory
from tests.test_plan import planned, tiny_setup


def context_traffic(s: cost.Setup) -> dict[str, comms.Comm]:
    return {
        c.kind: c for c in comms.collectives(s) if c.axes == ("context",) and c.kind != "all-reduce"
    }


def test_ulysses_plans_theorys_all_to_alls_instead_of_the_ring():
    """tiny (8 heads, 4 kv heads of 8) at cp=4, batch 8 x 1,024, fp32: per layer and pass q
    and the output [8, 256, 8, 8] and k and v [8, 256, 4, 8], forward and backward."""
    ring, ulysses = tiny_setup("cp=4"), tiny_setup("cp=4", cp_mode="ulysses")
    assert set(context_traffic(ring)) == {"collective-permute"}
    (moved,) = context_traffic(ulysses).values()
    layers = ulysses.shape.n_layers
    assert moved.kind == "all-to-all" and moved.group == 4
    assert moved.count == 4 * 2 * layers
    assert moved.count * moved.bytes == 2 * layers * 8 * 256 * 8 * 4 * 2 * (8 + 4)
    program = types.SimpleNamespace(
        layout=types.SimpleNamespace(
            mesh=types.SimpleNamespace(shape=ulysses.mesh), data_parallel=1, cp_mode="ulysses"
        ),
        accum=1,
        policy=types.SimpleNamespace(compute_dtype=jnp.float32),
    )
    theory = context_theory.ulysses_all_to_alls(program, ulysses.shape, 8, 1024)
    assert theory == (moved.count, moved.count * moved.bytes)
    # on the wire (cp - 1) / cp of it: 3/4 of the ring's sends for this model (docs: 1.125
    # against 1.50 MiB compiled at batch 4 x 256)
    wire = {s.cp_mode: comms.wire_bytes(c) * c.count for s in (ring, ulysses)
            for c in context_traffic(s).values()}  # fmt: skip
    assert wire["ulysses"] == pytest.approx(0.75 * wire["ring"])
    replayed = dataclasses.replace(ulysses, remat="full")  # the backward replays the forward
    assert context_traffic(replayed)["all-to-all"].count == moved.count * 3 // 2
    out = planned("--model", "tiny", "--mesh", "cp=4", "--batch", "8", "--seq-len", "1024",
                  "--precision", "fp32", "--cp-mode", "ulysses")  # fmt: skip
    x = out["long_sequence"]
    assert (x["cp_mode"], x["ring_count_per_layer"], x["ulysses_count_per_layer"]) == (
        "ulysses",
        0,
        8,
    )
    assert x["ulysses_bytes_per_layer"] == moved.count * moved.bytes // layers


def test_ulysses_activations_are_the_one_device_kernels_on_a_share_of_the_heads():
    """Ulysses holds the blockwise kernel's one block of scores for heads / cp heads and the
    gathered q, k, v and output where the ring holds its unmasked blocks and visiting key and
    value blocks: less (the compiled temp at batch 4 x 256: 10.83 against 16.85 MiB, 0.64;
    docs/strategies/long-sequences.md), and the scores computed are the causal kernel's."""
    ring = tiny_setup("cp=4", batch=4, seq_len=256)
    ulysses = dataclasses.replace(ring, cp_mode="ulysses")
    ratio = memory.activation_bytes(ulysses) / memory.activation_bytes(ring)
    assert 0.55 < ratio < 0.8, ratio  # 0.69 here
    assert long_sequence.score_share(1024, 4, "ulysses") == long_sequence.score_share(1024, 1)
    assert long_sequence.score_share(1024, 4) == pytest.approx(5 / 8)  # the ring's (cp + 1) / 2cp


def test_heads_that_ulysses_cannot_split_exit_2_with_one_line(capsys):
    with pytest.raises(UsageError, match="the 8 query heads do not divide by cp"):
        cost.check_setup(tiny_setup("cp=16", cp_mode="ulysses"))
    args = ["--model", "tiny", "--mesh", "cp=16", "--devices", "16", "--cp-mode", "ulysses"]
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --cp-mode ulysses with cp=16") and err.count("\n") == 1


def test_recommend_plans_ulysses_and_its_command_runs_it():
    """--recommend --cp-mode ulysses: the cp layouts are planned with Ulysses, the reasons
    name its all-to-alls and the train command carries the flag."""
    args = ["--params", "1e9", "--devices", "16", "--devices-per-node", "16", "--seq-len"]
    out = planned(*args, "131072", "--batch", "1", "--recommend", "--cp-mode", "ulysses")
    chosen = out["recommendation"]
    assert "cp=" in chosen["mesh_text"]  # one sequence of 131,072 tokens: only cp splits it
    assert any("Ulysses'" in line and "all-to-alls" in line for line in chosen["reasons"])
    assert "--cp-mode ulysses" in chosen["train_command"]
