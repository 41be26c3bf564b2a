"""`--scan-layers false` unrolls the layer loops (the plain scan, and ZeRO-3's prefetching
scan): the same losses as the scanned program, and no loop in the program JAX hands XLA
(XLA:CPU may still loop inside an op: a gather of the embedding, with the tests' flags)."""

import pytest

from tests import trainer

STEPS = 5
CASES = [  # (mesh, executor, remat): explicit ZeRO-3 with remat runs the prefetching scan
    ("dp=2,fsdp=2,tp=2", "auto", "none"),
    ("fsdp=8", "explicit", "full"),
]


@pytest.mark.parametrize("mesh, executor, remat", CASES)
def test_unrolled_layers_train_like_the_scan_and_compile_without_a_loop(mesh, executor, remat):
    losses = {}
    for scanned in (True, False):
        program = trainer.program(
            trainer.layout(mesh), 1, executor, remat=remat, scan_layers=scanned
        )
        lowered = program.lower_train_step(trainer.BATCH, trainer.SEQ_LEN)
        loops, step = lowered.as_text().count("stablehlo.while"), lowered.compile()
        assert loops >= 2 if scanned else loops == 0, (scanned, loops)  # forward and backward
        losses[scanned] = trainer.train_losses(program, STEPS, trainer.initial_state(), step)[0]
    assert trainer.max_relative_difference(losses[False], losses[True]) <= 1e-6
