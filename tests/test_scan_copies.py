"""The layer scan's copies (issue 48, docs/speed.md "The layer scan's copies"): in the tiny
model's compiled train step (remat none, one device) every while body writes its stacked
residuals in place (no copy of a whole [layers, ...] stack: a dynamic-update-slice that XLA
could not alias), copies at most the loop-carried activation, and the forward body writes no
more stacks than it did when the scan was measured, so a change that stacks more residuals
per layer (or copies them) fails here before a GPU shows it as memcpy time."""

import re

from spmd.estimate import hlo_text
from tests import trainer

# The forward body's stacked writes (dynamic-update-slice fusions) of the tiny model under
# remat none, measured with jax 0.10.2: the block input and its norms, q / k / v, gate, up and
# their product, softmax statistics, norm scales and the attention weights as reshaped for
# the matmuls (docs/speed.md). More means a new residual per layer.
FORWARD_STACK_WRITES = 26


def _while_bodies(comps: dict) -> list[str]:
    return [
        m.group(1)
        for instrs in comps.values()
        for _, _, opcode, attrs in instrs
        if opcode == "while" and (m := re.search(r"body=%?([^\s,}]+)", attrs))
    ]


def _calls(comps: dict, instr: tuple) -> list[tuple]:
    m = re.search(r"calls=%?([^\s,}]+)", instr[3])
    return comps.get(m.group(1), []) if m else []


def _dims(shape: str) -> list[int]:
    m = re.search(r"\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def test_the_layer_scan_writes_its_stacked_residuals_in_place():
    program, step = trainer.compiled("dp=1")
    cfg = trainer.tiny_config()
    assert cfg.remat == "none"
    comps, _ = hlo_text.parse_computations(step.as_text())
    bodies = _while_bodies(comps)
    stacked_bodies = []
    activation = trainer.BATCH * trainer.SEQ_LEN * cfg.embed_dim
    for body in bodies:
        instrs = comps[body]
        writes = [
            instr
            for instr in instrs
            if instr[2] == "fusion"
            and any(i[2] == "dynamic-update-slice" for i in _calls(comps, instr))
        ]
        if not any(_dims(shape)[:1] == [cfg.n_layers] for _, shape, *_ in writes):
            continue  # not the layer scan (e.g. XLA:CPU's loop inside an op)
        for name, shape, opcode, _ in instrs:
            if opcode == "copy":  # at most the carry: one activation, never a stack
                size = 1
                for d in _dims(shape):
                    size *= d
                assert size <= activation, (body, name, shape)
        for name, shape, *_ in writes:  # in place: the fusion's result is the whole stack
            assert _dims(shape)[:1] == [cfg.n_layers], (body, name, shape)
        stacked_bodies.append(len(writes))
    assert len(stacked_bodies) == 2, bodies  # the forward scan and the backward scan
    assert 0 < stacked_bodies[0] <= FORWARD_STACK_WRITES, stacked_bodies
