"""What a training run reports beyond its loss: TFLOP/s and MFU, device memory, stragglers,
and the --profile breakdown. spmd.train builds one Observer and asks it at each logged step.

Every train record gets the same keys on every backend (the JSONL contract of docs/contracts.md):
tflops_per_device, mfu (null where the peak is unknown), memory_bytes_in_use and
memory_peak_bytes (null where the backend keeps no allocator statistics), process_step_time_s
(one entry per process) and stragglers (process ids, usually empty).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from spmd.engine import objectives
from spmd.estimate import flops
from spmd.log import say
from spmd.observe import profile, stragglers
from spmd.observe.metrics import MetricsLog, device_memory
from spmd.sections import ObserveConfig, RunConfig

if TYPE_CHECKING:
    from models.contract import ModelConfig
    from spmd.engine.diloco import AnyCompiled, AnyProgram


@dataclasses.dataclass
class Observer:
    flops_per_step: float  # model FLOPs of one optimizer step, all devices together
    devices: int  # devices of the mesh
    local_devices: list  # this process's devices of the mesh (for memory statistics)
    peak: float | None  # dense peak TFLOP/s of one device; None: unknown, so no MFU
    peak_source: str  # where the peak came from, for messages
    straggler_threshold: float
    comm_warn: float
    profiler: profile.StepProfiler | None = None
    # (params, batch) -> the model's own metrics (device scalars) added to each logged train
    # record, taken on the step's batch before its update (an MoE model's router statistics)
    model_metrics: Any = None
    reference_forward: bool = False  # flops_per_step holds a reference model's forward too

    def model_fields(self, step: int, logged: bool, params: Any, batch: Any) -> dict[str, Any]:
        """The model's metrics for a logged step (before the step: its params are donated)."""
        return self.model_metrics(params, batch) if logged and self.model_metrics else {}

    def throughput(self, step_time_s: float) -> dict[str, float | None]:
        """tflops_per_device and mfu (a fraction, None without a peak) at this step time."""
        achieved = flops.achieved_tflops(self.flops_per_step, self.devices, step_time_s)
        return {
            "tflops_per_device": achieved,
            "mfu": flops.mfu(achieved, self.peak, self.peak_source),
        }

    def step_fields(self, step_time_s: float) -> dict[str, Any]:
        """The extra fields of a train record; names stragglers on the console. In a
        multi-process job every process must call this at the same steps."""
        times = stragglers.gather_step_times(step_time_s)
        slow = stragglers.find_stragglers(times, self.straggler_threshold)
        if slow:
            say(stragglers.describe(times, slow))
        return {
            **self.throughput(step_time_s),
            **device_memory(self.local_devices),
            "process_step_time_s": times,
            "stragglers": slow,
        }

    def before_step(self, step: int, in_flight: Any) -> float:
        """Seconds spent on profiling before this step's dispatch (not step time)."""
        return self.profiler.before_step(step, in_flight) if self.profiler is not None else 0.0

    def after_step(self, step: int, outputs: Any, log: MetricsLog) -> float:
        """At the end of the --profile window: print and log the breakdown and warn if
        communication takes more than comm_warn of the step. Returns the seconds spent on
        profiling (not step time)."""
        if self.profiler is None:
            return 0.0
        table, spent = self.profiler.after_step(step, outputs)
        if table is None:
            return spent
        start, stop = self.profiler.first_traced, step
        if not table:
            say(f"profile: the trace of steps {start}-{stop} holds no XLA op events to break down")
            return spent
        mean = profile.mean_row(table)
        say(
            f"profile of steps {start}-{stop} (trace in {self.profiler.trace_dir}; TensorBoard "
            f"or Perfetto show it):\n{profile.format_breakdown(table)}"
        )
        if mean["comm_fraction"] > self.comm_warn:
            say(
                f"warning: communication takes {mean['comm_fraction']:.0%} of the step (above "
                f"--comm-warn {self.comm_warn:.0%}); consider a layout that communicates less"
            )
        log.write(
            "profile",
            step=stop,
            first_step=start,
            comm_fraction=mean["comm_fraction"],
            step_time_s=mean["step"],
            devices=table,
        )
        return spent


def make_observer(
    observe: ObserveConfig,
    run: RunConfig,
    precision: str,
    model_cfg: ModelConfig,
    mesh: Any,
    compiled: AnyCompiled,
    reference_precomputed: bool = False,
) -> Observer:
    """An Observer for a run (`run`'s steps, batch and sequence length, in `precision`) on
    `mesh` with the compiled step, reporting as `observe` says (`reference_precomputed`: DPO's
    reference log-probs come with the data, so the step runs no reference forward)."""

    device_kind = mesh.devices.flat[0].device_kind
    peak = flops.peak_tflops(device_kind, precision, observe.peak_tflops)
    source = "--peak-tflops" if observe.peak_tflops > 0 else f"the {device_kind} {precision} peak"
    profiler = None
    if observe.profile:
        window = profile.parse_window(observe.profile, run.steps)
        trace_dir = Path(observe.profile_dir or observe.tensorboard or "profile")
        if jax.process_count() > 1:
            trace_dir = trace_dir / f"process_{jax.process_index()}"
        profiler = profile.StepProfiler(window, str(trace_dir), profile.module_name(compiled))
    # an objective with a reference (DPO) runs the reference's forward too: a third of a
    # token's forward + backward
    reference = objectives.get(run.objective).reference is not None and not reference_precomputed
    passes = 4 / 3 if reference else 1.0
    return Observer(
        flops_per_step=flops.decoder_flops_per_token(model_cfg, run.seq_len)
        * passes
        * run.batch
        * run.seq_len,
        devices=mesh.size,
        local_devices=[d for d in mesh.devices.flat if d.process_index == jax.process_index()],
        peak=peak,
        peak_source=source,
        straggler_threshold=observe.straggler_threshold,
        comm_warn=observe.comm_warn,
        profiler=profiler,
        reference_forward=reference,
    )


def model_metrics(program: AnyProgram, metrics_fn: Any) -> Any:
    """jitted (params, batch) -> metrics_fn(model, batch): a forward pass under the auto layout
    of the program's mesh (the same math under either executor), metrics replicated. Under
    context parallelism the batch is put in the ring's order and attention runs as the step's
    does (the loss's own wrapper, spmd.engine.step, does the same for the step)."""

    from spmd.parallel import hooks, traced_layout

    layout = program.layout
    mesh, zero = layout.mesh, layout.zero_stage

    def run(params: Any, batch: Any) -> Any:
        with (
            traced_layout.activation_layout(mesh, zero),
            traced_layout.context_attention(layout.cp_mode),
        ):
            return metrics_fn(program.model(params), hooks.split_sequences(batch))

    return jax.jit(run, out_shardings=program.layout.replicated)


def dry_run_report(observer: Observer, compiled: AnyCompiled, device_kind: str) -> str:
    """FLOPs per step three ways and the peak that MFU will use."""
    comparison = flops.format_comparison(
        observer.flops_per_step,
        flops.cost_analysis_flops(compiled),
        flops.hlo_dot_flops(compiled),
        observer.devices,
        "model: 8 N tokens + attention (+ reference)" if observer.reference_forward else "",
    )
    if observer.peak is None:
        peak = f"MFU: no peak known for {device_kind!r}, so none is shown (--peak-tflops sets one)"
    else:
        peak = f"MFU against {observer.peak_source}: {observer.peak:g} TFLOP/s per device"
    return f"{comparison}\n{peak}"
