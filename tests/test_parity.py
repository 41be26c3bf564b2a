"""Oracle 1: every layout, under both executors (XLA's partitioner and hand-written
collectives), gives the 1-device fp32 loss trajectory (relative diff <= 1e-4)."""

import jax
import numpy as np
import pytest

from tests import trainer
from tests.tiny_run import EXECUTORS

LAYOUTS = [
    ("dp=8", 3),
    ("fsdp=8", 1),
    ("fsdp=8", 2),
    ("fsdp=8", 3),
    ("dp=2,tp=4", 3),
    ("dp=2,fsdp=2,tp=2", 3),
]


def losses_of(mesh: str, zero: int = 3, executor: str = "auto") -> tuple:
    return trainer.losses(mesh, zero, executor)


@pytest.fixture(scope="module")
def reference():
    return losses_of("dp=1")


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("mesh,zero", LAYOUTS)
def test_loss_trajectory_matches_one_device(reference, mesh, zero, executor):
    ref_losses, ref_params = reference
    losses, params = losses_of(mesh, zero, executor)
    assert len(losses) == trainer.STEPS
    assert trainer.max_relative_difference(losses, ref_losses) <= 1e-4
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it trains, so parity is not trivial
    flat, ref_flat = jax.tree.leaves(params), jax.tree.leaves(ref_params)
    for leaf, ref_leaf in zip(flat, ref_flat, strict=True):
        np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-3, atol=2e-5)
