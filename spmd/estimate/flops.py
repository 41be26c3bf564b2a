"""FLOPs per optimizer step, achieved TFLOP/s per device, and MFU that is never wrong.

Model FLOPs are the model's own (spmd.model_shape.ModelShape.flops_per_token: the usual
convention for a decoder-only transformer, 6 FLOPs per matmul parameter per token plus
attention's two [length x length] matmuls). Recomputation (remat) is not model work, so it is
not counted.

The compiled program is read two ways, to check the formula: XLA's own cost analysis (which
counts the body of a while loop once, so a scanned model's layers are undercounted) and the
dot instructions of the partitioned HLO multiplied by their loops' trip counts (our count:
no library weighs cost by trip count).

MFU = achieved / peak, with the peak from a table keyed by the device kind and the compute
precision, or from --peak-tflops. Where neither knows the device (a CPU), MFU is None rather
than a guess; an MFU above 100% means the peak or the FLOP count is wrong and is refused.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from spmd.errors import UsageError
from spmd.estimate import hlo, hlo_text

if TYPE_CHECKING:
    from models.contract import ModelConfig
    from spmd.engine.diloco import AnyCompiled

# Dense peak TFLOP/s of one JAX device (no structured sparsity), per compute precision.
# Matched by substring of `jax.Device.device_kind`, first match wins, so specific names come
# first. "fp32" is the peak that XLA's default matmul precision reaches with fp32 inputs: TF32
# tensor cores on A100 / H100 / H200, one bf16 pass on TPUs. Using that (higher) figure keeps
# MFU from ever being overstated. TPU v2/v3 devices are single cores (half a chip).
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp32": 378.0}),
    ("H100 NVL", {"bf16": 835.5, "fp32": 417.5}),
    ("H100", {"bf16": 989.4, "fp32": 494.7}),  # SXM
    ("H200 NVL", {"bf16": 835.5, "fp32": 417.5}),
    ("H200", {"bf16": 989.4, "fp32": 494.7}),  # SXM
    ("A100", {"bf16": 312.0, "fp32": 156.0}),  # SXM and PCIe alike
    ("TPU v6 lite", {"bf16": 918.0, "fp32": 918.0}),  # v6e (Trillium)
    ("TPU v5 lite", {"bf16": 197.0, "fp32": 197.0}),  # v5e
    ("TPU v5", {"bf16": 459.0, "fp32": 459.0}),  # v5p
    ("TPU v4", {"bf16": 275.0, "fp32": 275.0}),
    ("TPU v3", {"bf16": 61.5, "fp32": 61.5}),
    ("TPU v2", {"bf16": 22.5, "fp32": 22.5}),
)
# Compute dtypes that run at the 16-bit tensor-core rate. fp8 is there too: its MFU is taken
# against the bf16 peak (as torchtitan's and Megatron's "bf16-equivalent" figures are), though
# its block matmuls may run at FP8_MATMUL_SPEEDUP times that rate.
HALF_PRECISIONS = ("bf16", "fp16", "fp8")
# Dense fp8 tensor-core rate over the bf16 one on Hopper and Ada (H100 SXM: 1979 vs 989 TFLOP/s)
FP8_MATMUL_SPEEDUP = 2.0


def decoder_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs (forward + backward) per trained token of model config `cfg` (any model
    family's: the formula is its shape's, spmd.model_shape.ModelShape.flops_per_token)."""
    return cfg.shape().flops_per_token(seq_len)


def cost_analysis_flops(compiled: AnyCompiled) -> float | None:
    """FLOPs of one execution on one device as XLA's cost analysis reports them (None if the
    backend gives none). A while loop's body is counted once, whatever its trip count."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends raise instead of returning nothing
        return None
    if isinstance(analysis, list):  # older jax: one dict per program
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops is not None and flops >= 0 else None


def hlo_dot_flops(compiled: AnyCompiled | str) -> float:
    """Matmul FLOPs of one execution on one device: 2 * output elements * contracted size of
    every dot in the partitioned HLO, times the trip counts of the loops around it; a dot in
    one of a conditional's n branches counts 1/n of the conditional's executions."""
    text = compiled if isinstance(compiled, str) else hlo.optimized_text(compiled)
    instrs = hlo.instructions(text)
    expected = hlo_text.expected_multipliers(*hlo_text.parse_computations(text))
    shapes = {(comp, name): shape for comp, name, shape, *_ in instrs}
    total = 0.0
    for comp, _, shape, opcode, attrs, _ in instrs:
        count = expected.get(comp, 0)
        if opcode != "dot" or count == 0:
            continue
        # The first operand, with its shape printed inline or only by name.
        lhs = re.match(r"\s*dot\(\s*(?:([a-z]\w*\[[^\]]*\])\S*\s+)?%?([\w.\-]+)", attrs)
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
        lhs_shape = (lhs.group(1) or shapes.get((comp, lhs.group(2)), "")) if lhs else ""
        lhs_dims = _dims(lhs_shape)
        dims = [int(i) for i in contracting.group(1).split(",") if i] if contracting else []
        if lhs_dims is None or any(i >= len(lhs_dims) for i in dims):
            continue  # an operand we cannot size; leave it out rather than guess
        contracted = math.prod(lhs_dims[i] for i in dims)
        total += 2.0 * math.prod(_dims(shape) or [0]) * contracted * count
    return total


def _dims(shape: str) -> list[int] | None:
    """Dimensions of an array shape "f32[16,32]{1,0}" -> [16, 32]; None for tuples or junk."""
    m = re.match(r"[a-z]\w*\[([\d,]*)\]", shape.strip())
    return [int(d) for d in m.group(1).split(",") if d] if m else None


def peak_tflops(device_kind: str, precision: str = "fp32", override: float = 0.0) -> float | None:
    """Peak dense TFLOP/s of one device: `override` when positive, else the table's entry for
    the device kind at this precision, else None (unknown hardware, e.g. a CPU)."""
    if override > 0:
        return override
    rate = "bf16" if precision in HALF_PRECISIONS else "fp32"
    for name, peaks in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return peaks[rate]
    return None


def achieved_tflops(flops_per_step: float, devices: int, step_time_s: float) -> float:
    """Model TFLOP/s per device: the step's FLOPs shared evenly over the devices."""
    return flops_per_step / devices / step_time_s / 1e12


def mfu(achieved: float, peak: float | None, peak_source: str) -> float | None:
    """achieved / peak (a fraction), None when the peak is unknown. UsageError when it would
    exceed 1: the peak (named by `peak_source`) cannot be right then."""
    if peak is None:
        return None
    utilisation = achieved / peak
    if utilisation > 1.0:
        raise UsageError(
            f"{peak_source} {peak:g} TFLOP/s is below the achieved {achieved:.3g} TFLOP/s per "
            f"device (MFU {utilisation:.0%}); give the device's real dense peak with --peak-tflops"
        )
    return utilisation


def format_comparison(
    model_flops: float, cost_flops: float | None, dot_flops: float, devices: int, label: str = ""
) -> str:
    """Dry-run lines: FLOPs per optimizer step from the formula (`label` names it; empty:
    6 N tokens + attention) and from the compiled step (per-device counts times the device
    count), with their ratio to the formula."""

    def row(label: str, value: float | None) -> str:
        if value is None:
            return f"  {label:<44}{'n/a':>12}"
        return f"  {label:<44}{value / 1e9:>10.3f} G  ({value / model_flops:.2f} x model)"

    return "\n".join(
        [
            "FLOPs per optimizer step (all devices):",
            row(label or "model: 6 N tokens + attention", model_flops),
            row("compiled: dot instructions x loop trips", dot_flops * devices),
            row("compiled: XLA cost analysis (loops once)", cost_flops and cost_flops * devices),
        ]
    )
