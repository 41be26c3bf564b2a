"""--dry-run's table: the compiled step's collectives and memory (spmd.estimate.hlo) beside the
layout's textbook figures (spmd.estimate.theory), with their ratios, in the units of both."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spmd.estimate import hlo, theory, units
from spmd.model_shape import ModelShape

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyCompiled, AnyProgram


def report(
    program: AnyProgram,
    compiled: AnyCompiled,
    model: ModelShape,
    global_batch: int,
    seq_len: int,
    pipeline: dict | None = None,
) -> str:
    """The table: the compiled step's collectives and memory beside the layout's theoretical
    figures, with ratios. `pipeline`: the schedule's summary (spmd.parallel.schedules) when
    pp > 1, whose activation sends are set beside the compiled collective-permutes."""
    measured = hlo.collective_summary(hlo.collectives(compiled, program.layout.mesh))
    expected = theory.collectives(program, model, global_batch, seq_len, pipeline)
    if pipeline is not None:
        stage = theory.pipeline_sends(program, model, pipeline, global_batch, seq_len)
        ring = theory.pipelined_ring_sends(program, model, pipeline, global_batch, seq_len)
        expected["collective-permute"] = {k: stage[k] + ring[k] for k in stage}
    text = format_comparison(
        measured, expected, hlo.memory(compiled), theory.memory(program, global_batch, seq_len)
    )
    if theory.prefetching(program, model) and theory.gathered_layer_bytes(program):
        # the layer computing, the next one gathering, and the last one kept for backward
        text += "\nZeRO-3 prefetch holds up to 3 layers gathered at once"
    if pipeline is not None:
        text += (
            "\nwith pp > 1 the expected figures leave out ZeRO-3's gathers and reduce-scatters "
            "per tick (theory counts them once per micro-batch, as without a pipeline)"
        )
    if model.n_experts:
        element_bytes = theory.activation_bytes(program)
        experts = theory.program_all_to_all(program, model, global_batch, seq_len, element_bytes)
        text += f"\n{theory.expert_summary(program, experts)}"
    return text


def format_comparison(measured: dict, expected: dict, mem: dict, expected_mem: dict) -> str:
    """Table of measured vs expected collectives (per kind) and memory, with ratios."""

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3f}" if b else ("-" if not a else "inf")

    lines = [
        f"{'collective':<16}{'count':>7}{'expected':>10}{'bytes/step':>14}{'expected':>14}"
        f"{'ratio':>8}  axes"
    ]
    for kind in sorted(set(measured) | set(expected)):
        m = measured.get(kind, {"count": 0, "bytes": 0, "axes": []})
        e = expected.get(kind, {"count": 0, "bytes": 0})
        lines.append(
            f"{kind:<16}{m['count']:>7}{e['count']:>10}{units.binary(m['bytes']):>14}"
            f"{units.binary(e['bytes']):>14}{ratio(m['bytes'], e['bytes']):>8}  "
            + ", ".join(a or "?" for a in m.get("axes", []))
        )
    lines.append(f"{'memory per device':<33}{'bytes':>14}{'expected':>14}{'ratio':>8}")
    for key, value in mem.items():
        want = expected_mem.get(key)
        shown = units.binary(want) if want is not None else ""
        lines.append(
            f"{key:<33}{units.binary(value):>14}{shown:>14}"
            f"{ratio(value, want) if want is not None else '':>8}"
        )
    if expected_mem.get("gathered_layer"):
        layer = units.binary(expected_mem["gathered_layer"])
        lines.append(f"{'one layer gathered (ZeRO-3)':<33}{'':>14}{layer:>14}")
    lines.append("expected counts are calls, before XLA's combiner fuses some of them")
    if "reduce-scatter" in expected and "reduce-scatter" not in measured:
        lines.append(
            "no reduce-scatter compiled: XLA's partitioner reduced the gradients with "
            "all-reduces (as XLA:CPU does under --collectives auto; explicit shows the true op)"
        )
    return "\n".join(lines)
