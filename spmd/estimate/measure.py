"""Check the analytic plan against the compiled step (`python -m spmd.plan --measure`).

Compiles the real train step (built by spmd.run.builder, AOT: nothing runs) for a planned layout on
simulated CPU devices and puts the figures of spmd.estimate.memory and .cost beside the
compiled ones: bytes of params and of master + optimizer state per device (from the shardings
the step takes its state in, spmd.engine.state_layout.state_bytes_per_device), the compiled
peak memory, and the bytes of each collective kind per optimizer step (spmd.estimate.hlo). All
figures are bytes per device.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import jax

from spmd.engine import offload as engine_offload
from spmd.engine.state_layout import state_bytes_per_device
from spmd.errors import UsageError
from spmd.estimate import comms, cost, memory, timing
from spmd.estimate import offload as offload_model
from spmd.parallel import mesh as mesh_lib
from spmd.parallel.mesh import format_mesh
from spmd.sections import OptimizerConfig, PrecisionConfig, RunConfig

if TYPE_CHECKING:
    from models.contract import ModelConfig
    from spmd.engine.diloco import AnyProgram


# fp16 is left out: XLA:CPU cannot compile its matmuls (no F16_F16_F32 dot_general).
COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}


def simulated_devices(count: int) -> list:
    """`count` CPU devices: simulated now if JAX has not started its backend, else the first
    `count` of the CPU devices it has (e.g. under pytest). UsageError if there are too few."""

    try:
        if not mesh_lib.cpu_only():
            jax.config.update("jax_platforms", "cpu")
        # Never fewer than already asked for: other code in this process may rely on them.
        wanted = max(count, int(jax.config.values["jax_num_cpu_devices"] or 0))
        mesh_lib.simulate_cpu_devices(wanted, announce=False)
    except RuntimeError:  # the backend has started: use the devices it has
        pass
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise UsageError(
            f"--measure needs {count} simulated CPU devices but JAX has started with "
            f"{len(devices)}; run it in a fresh process"
        )
    return devices[:count]


# XLA:CPU runs neither ReduceScatterCreator nor AllReduceReassociate, which XLA:GPU's pipeline
# runs: under the auto executor it reports a reduce-scatter as the all-reduce of its whole
# buffer, and the backward pass reduces the input-gradient partial sums of q, k and v, and of
# the MLP's gate and up, one by one before adding them: 5 per layer where Megatron has 2.
CPU_SEPARATE_INPUT_GRAD_REDUCTIONS = 3


def separate_reductions(s: cost.Setup, cpu_auto: bool) -> bool:
    """Whether the compiled step reduces the tp input gradients one by one (XLA:CPU, auto)."""
    return cpu_auto and s.mesh["tensor"] > 1


def predicted_collectives(s: cost.Setup, cpu_auto: bool) -> dict:
    """Analytic bytes per step by collective kind, in spmd.estimate.hlo's convention; with
    `cpu_auto` (the auto executor compiled by XLA:CPU) as that program reduces: reduce-scatters
    as whole-buffer all-reduces, and 3 more tensor-parallel reductions per layer backward."""
    out: dict[str, float] = {}
    for c in comms.collectives(s):
        kind, size = c.kind, c.bytes * c.count
        if cpu_auto and kind == "reduce-scatter":
            kind, size = "all-reduce", size * c.group
        out[kind] = out.get(kind, 0.0) + size
    if separate_reductions(s, cpu_auto):
        executions, layers = comms.tensor_passes(s)
        separate = CPU_SEPARATE_INPUT_GRAD_REDUCTIONS * layers * executions
        out["all-reduce"] = out.get("all-reduce", 0.0) + separate * comms.activation_bytes(s)
    return out


def check_engine_can_build(s: cost.Setup) -> None:
    """UsageError unless the engine has the dtype policy of `s` (it builds every optimizer
    the planner knows: both read spmd.engine.optimizers)."""
    if s.precision not in COMPUTE_DTYPES:
        raise UsageError(
            f"--measure compiles the engine's step on CPU, which takes --precision fp32, bf16 "
            f"or fp8 (fp16 holds the same state bytes as bf16), not {s.precision}"
        )


def measure(s: cost.Setup, program: AnyProgram, mesh: Any, executor: str = "auto") -> dict:
    """Compile `program`'s train step (built for layout `s` on `mesh`, by spmd.run.builder) and
    compare it with the analytic figures of `s`.

    `s.n_params` must be the built model's parameter count (compare like with like);
    `executor` is the one the step uses. XLA:CPU reports an auto-mode reduce-scatter as an
    all-reduce of the whole buffer, so on CPU with the auto executor the analytic
    reduce-scatters are counted that way. Returns {"rows": {what: {"analytic", "compiled"
    (bytes), "ratio" (compiled/analytic)}}, "compiled_memory", "compile_s", "device", ...}."""

    from spmd.estimate import hlo

    devices = list(mesh.devices.flat)
    started = time.perf_counter()
    compiled = program.compile_train_step(s.batch, s.seq_len)
    compile_s = time.perf_counter() - started

    state = memory.model_state_bytes(s)
    held = state_bytes_per_device(compiled, program)
    rows = {
        "params": (state["params"], held["params"]),
        "master + optimizer state": (state["optimizer"], held["opt_state"]),
    }
    # --offload: where the step takes its state in, by the memory kinds of its input shardings
    placed = offload_model.split(state, s.offload)
    by_memory = engine_offload.state_bytes_by_memory(compiled, program)
    compiled_split = engine_offload.totals(by_memory)
    if s.offload != "none":
        rows["state in device memory"] = (placed["device"], compiled_split["device"])
        rows["state in host memory"] = (placed["host"], compiled_split["host"])
    compiled_memory = hlo.memory(compiled)
    if "temp" in compiled_memory:  # what activations and the step's buffers take
        rows["activations vs compiled temp"] = (memory.activation_bytes(s), compiled_memory["temp"])
    device_peak = engine_offload.device_peak(compiled_memory, compiled_split["host"])
    if device_peak is not None:  # the state kept in host memory left out of both
        analytic_peak = state["model_state"] - placed["host"] + memory.activation_bytes(s)
        rows["model state + activations"] = (analytic_peak, device_peak)
    cpu_auto = executor == "auto" and devices[0].platform == "cpu"
    predicted = predicted_collectives(s, cpu_auto)
    compiled_comm = hlo.collective_summary(hlo.collectives(compiled, mesh))
    for kind in dict.fromkeys([*predicted, *compiled_comm]):
        got = compiled_comm.get(kind, {}).get("bytes", 0)
        rows[f"{kind} bytes/step"] = (predicted.get(kind, 0.0), got)
    notes = []
    if s.fp8_all_gather:  # XLA:CPU gathers e4m3 and bf16 in f32: read the program spmd emits
        gathers = lowered_gathers(program, s.batch, s.seq_len, mesh)
        rows[f"all-gather bytes/step, lowered ({gathers['dtypes']})"] = (
            predicted.get("all-gather", 0.0),
            gathers["bytes"],
        )
        notes.append(
            "XLA:CPU promotes the e4m3 and bf16 all-gathers to f32 when it compiles; the "
            "lowered program's row is what a GPU compiler receives"
        )
    if cpu_auto and any(c.kind == "reduce-scatter" for c in comms.collectives(s)):
        notes.append(
            "XLA:CPU reports an auto-mode reduce-scatter as an all-reduce of the whole "
            "buffer; the analytic reduce-scatters are counted that way here"
        )
    if separate_reductions(s, cpu_auto):
        notes.append(
            "XLA:CPU all-reduces the backward's q, k, v and gate, up input gradients one by one "
            "(XLA:GPU adds them first: AllReduceReassociate); the analytic all-reduces count "
            f"{CPU_SEPARATE_INPUT_GRAD_REDUCTIONS} more per layer here"
        )
    if devices[0].platform == "cpu" and s.precision == "bf16":  # seen on jax 0.10.2
        kinds = "all-reduces and all-to-alls" if "all-to-all" in predicted else "all-reduces"
        notes.append(f"XLA:CPU runs bf16 {kinds} in f32: twice the activation bytes")
    return {
        "device": f"{len(devices)} simulated {devices[0].platform} devices",
        "executor": executor,
        "mesh_text": format_mesh(dict(mesh.shape)),
        "n_params": int(s.n_params),
        "compile_s": compile_s,
        "compiled_memory": compiled_memory,
        "rows": {
            what: {"analytic": round(a), "compiled": int(b), "ratio": b / a if a else None}
            for what, (a, b) in rows.items()
        },
        "notes": notes,
        "jax": jax.__version__,
    }


def lowered_gathers(program: AnyProgram, batch: int, seq_len: int, mesh: Any) -> dict[str, Any]:
    """The all-gathers of the train step as spmd emits it (lowered, before XLA optimizes it):
    {"bytes": per device per step, "dtypes": e.g. "bf16 + f32 + f8e4m3fn", "by_dtype": bytes
    per element type}."""
    from spmd.estimate import hlo

    lowered = program.lower_train_step(batch, seq_len)
    by_dtype: dict[str, int] = {}
    for c in hlo.collectives(lowered, mesh):
        if c.kind == "all-gather":
            by_dtype[c.dtype] = by_dtype.get(c.dtype, 0) + c.bytes * c.count
    return {
        "bytes": sum(by_dtype.values()),
        "dtypes": " + ".join(sorted(by_dtype)),
        "by_dtype": by_dtype,
    }


def fp8_gather_line(program: AnyProgram, shape: Any, batch: int, seq_len: int) -> str:
    """Dry-run line of --fp8-all-gather: the lowered program's all-gather bytes per dtype
    beside the theory's (spmd.estimate.theory, e4m3 for the blocks' matrices)."""
    from spmd.estimate import theory

    gathers = lowered_gathers(program, batch, seq_len, program.layout.mesh)
    expected = theory.collectives(program, shape, batch, seq_len)["all-gather"]["bytes"]
    parts = ", ".join(f"{d} {b / 2**10:.2f} KiB" for d, b in sorted(gathers["by_dtype"].items()))
    return (
        f"fp8 all-gather, lowered program (XLA:CPU compiles it in f32): {parts}; "
        f"{gathers['bytes'] / 2**10:.2f} KiB/step vs {expected / 2**10:.2f} KiB theory "
        f"(x{gathers['bytes'] / expected:.3f})"
    )


def state_against_formula(
    run: RunConfig,
    zero: int,
    precision: PrecisionConfig,
    model_cfg: ModelConfig,
    mesh_sizes: dict[str, int],
    held: dict[str, int],
    by_memory: dict[str, dict[str, int]] | None = None,
    offload: str = "none",
    lora_fields: dict[str, Any] | None = None,
    optimizer: OptimizerConfig | str = OptimizerConfig.optimizer,
    reference_precomputed: bool = False,
) -> str:
    """Dry-run line: the per-device bytes of params and of master + optimizer state that the
    compiled step takes (`held`, from spmd.engine.state_layout.state_bytes_per_device) beside
    the ZeRO paper's formula for the same layout (spmd.estimate.memory), with compiled/formula
    ratios; under --offload also the bytes in device and in host memory (`by_memory`, from
    spmd.engine.offload.state_bytes_by_memory) beside the formula's split.
    `model_cfg` is the run's model config (any family's: it describes its shape); `optimizer`
    the run's optimizer section (or its --optimizer name: its other fields' defaults)."""
    if isinstance(optimizer, str):
        optimizer = OptimizerConfig(optimizer=optimizer)
    s = cost.Setup(
        shape=model_cfg.shape(),  # any model family's config describes its shape
        n_params=model_cfg.shape().n_params(),
        mesh=dict(mesh_sizes),
        zero=zero,
        precision=precision.precision,
        optimizer=optimizer.optimizer,
        adafactor_min_dim=optimizer.adafactor_min_dim,
        batch=run.batch,
        seq_len=run.seq_len,
        accum=run.accum,
        grad_reduce=precision.grad_reduce,
        **(lora_fields or {}),  # LoRA: spmd.estimate.lora.of_run
        objective=run.objective,
        reference_precomputed=reference_precomputed,  # --dpo-precompute-reference
    )
    state = memory.model_state_bytes(s)
    parts = []
    for name, formula_bytes, held_bytes in (
        ("params", state["params"], held["params"]),
        ("master + optimizer", state["optimizer"], held["opt_state"]),
    ):
        parts.append(
            f"{name} {held_bytes / 2**20:.2f} MiB compiled vs {formula_bytes / 2**20:.2f} MiB "
            f"formula (x{held_bytes / formula_bytes:.3f})"
        )
    per_param = memory.bytes_per_param(s)
    line = (
        f"state per device against the ZeRO formula ({per_param['params']} + "
        f"{per_param['grads']} + {per_param['optimizer']:g} B/param, stage {zero}): "
        + "; ".join(parts)
    )
    line += "\n" + timing.reference_words(s, state) if s.reference_forward else ""
    if offload == "none" or by_memory is None:
        return line
    formula = offload_model.split(state, offload)
    compiled = engine_offload.totals(by_memory)
    split = "; ".join(
        f"{where} memory {compiled[where] / 2**20:.2f} MiB compiled vs "
        f"{formula[where] / 2**20:.2f} MiB formula"
        for where in ("device", "host")
    )
    return f"{line}\n--offload {offload}, params + master + optimizer per device: {split}"
