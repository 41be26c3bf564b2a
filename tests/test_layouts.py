"""Oracles 3 and 4 on the compiled step: which collectives a layout produces, and how much
params + optimizer state one device holds."""

import pytest

from spmd.engine.state_layout import state_bytes_per_device
from spmd.estimate import hlo
from tests import trainer


def compiled(mesh: str, zero: int = 3):
    return trainer.compiled(mesh, zero)


@pytest.fixture(scope="module")
def one_device():
    return compiled("dp=1")


def total(state_bytes: dict) -> int:
    return state_bytes["params"] + state_bytes["opt_state"]


def test_zero3_over_8_holds_at_most_a_sixth_of_the_state(one_device):
    prog1, comp1 = one_device
    prog8, comp8 = compiled("fsdp=8", 3)
    single, sharded = total(state_bytes_per_device(comp1, prog1)), None
    sharded = total(state_bytes_per_device(comp8, prog8))
    assert sharded <= single / 6
    # the compiler's own account of the arguments agrees (batch and scalars are small)
    assert hlo.memory(comp8)["argument"] < hlo.memory(comp1)["argument"] / 6


def test_zero1_shards_only_the_optimizer_state(one_device):
    prog1, comp1 = one_device
    prog, comp = compiled("fsdp=8", 1)
    single, zero1 = state_bytes_per_device(comp1, prog1), state_bytes_per_device(comp, prog)
    assert zero1["params"] == single["params"]
    assert zero1["opt_state"] <= single["opt_state"] / 6


def test_one_device_step_has_no_collectives(one_device):
    _, comp = one_device
    assert hlo.collectives(comp) == []


def test_ddp_all_reduces_the_gradients(one_device):
    prog1, comp1 = one_device
    param_bytes = state_bytes_per_device(comp1, prog1)["params"]
    prog, comp = compiled("dp=8")
    summary = hlo.collective_summary(hlo.collectives(comp, prog.layout.mesh))
    assert set(summary) == {"all-reduce"}
    assert summary["all-reduce"]["axes"] == ["data"]
    # every gradient crosses the wire once (plus the scalar loss and norm)
    assert param_bytes <= summary["all-reduce"]["bytes"] <= param_bytes * 1.01


def test_zero3_all_gathers_the_parameters(one_device):
    prog1, comp1 = one_device
    param_bytes = state_bytes_per_device(comp1, prog1)["params"]
    prog, comp = compiled("fsdp=8", 3)
    summary = hlo.collective_summary(hlo.collectives(comp, prog.layout.mesh))
    assert summary["all-gather"]["axes"] == ["fsdp"]
    # gathered params: at least the whole model (7/8 of it comes from other devices) once
    assert summary["all-gather"]["bytes"] >= param_bytes
