"""Every example runs as a user would run it and checks what it claims (exit 0; each prints
FAILED and exits 1 when its claim does not hold)."""

import os
import subprocess
import sys

import pytest

from tests.cli import ROOT

EXAMPLES = {
    "allreduce_by_hand.py": ("byte-for-byte identical",),
    "accumulation.py": ("same update from 4 micro-batches as from one big batch",),
    "memory_fit.py": ("match the formula", "ZeRO-3"),
    "sequence_classifier.py": ("same test accuracy on 1 and 4 devices under dp and fsdp",),
    "custom_loop.py": ("restored onto another mesh gives the same eval loss",),
    "finetune.py": ("the loss counts only the response tokens", "fine-tuned from the Hugging"),
    "diloco.py": ("H=10 ends within 5% of synchronous training's loss",),
    "async_checkpoint.py": ("step time, save in flight:", "save() blocking the loop:"),
}
# Arguments that keep an example within the tests' time (its defaults make the README figures).
ARGS = {
    "diloco.py": ("--steps", "50", "--every", "10"),
    "async_checkpoint.py": ("--model", "tiny", "--mesh", "fsdp=2", "--saves", "2"),
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_and_checks_its_claim(script):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *ARGS.get(script, ())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for claim in EXAMPLES[script]:
        assert claim in result.stdout
