"""The optimizer-step loop of `python -m spmd.train`: steps, progress, eval (run by
spmd.training.evaluation), checkpoints.

Every step's metrics are fetched only after the next step is dispatched (or at once before an
eval or a save, which wait for the step anyway), so the host never stalls the device; each is
checked for divergence (spmd.training.divergence), and logged steps are reported. Checkpoints are
saved every --checkpoint-every steps, at the end, and when a stop signal or --stop-after ends
the run early, unless the step diverged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmd.io import epochs
from spmd.log import say
from spmd.observe.metrics import MetricsLog, progress_line
from spmd.sections import Config
from spmd.training import divergence
from spmd.training.evaluation import make_evaluator
from spmd.training.resume import finish_stopped, run_data_state
from spmd.training.step_clock import StepClock

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyProgram


def train_record(
    step: int, metrics: dict, step_time_s: float, schedule: Any, tokens_per_step: int
) -> dict[str, Any]:
    """The JSONL "train" record of optimizer step `step` (1-based) from the step's metrics
    (fetched to the host): the same keys under every precision policy."""
    skipped = int(metrics["skipped_steps"])
    return {
        "step": step,
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        # Skipped (fp16 overflow) steps leave the optimizer's step count, so its LR, as it was.
        "lr": float(schedule(step - 1 - skipped)),
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_step / step_time_s,
        "loss_scale": float(metrics["loss_scale"]),  # 1.0 unless --precision fp16
        "skipped_steps": skipped,  # cumulative
        # and the model's own metrics when it has any (an MoE model's router statistics):
        # numbers, or lists of numbers (per layer)
        **{k: _number(v) for k, v in metrics.items() if k not in _STEP_METRICS},
    }


def _number(value: Any) -> float | list[float]:
    """A fetched metric as JSON: a float, or a list of floats for an array (flattened)."""
    return float(value) if np.ndim(value) == 0 else [float(v) for v in np.ravel(value)]


_STEP_METRICS = ("loss", "grad_norm", "loss_scale", "skipped_steps")


@dataclasses.dataclass
class Run:
    """What the step loop works with, built once by `python -m spmd.train`."""

    cfg: Config  # the resolved config, saved with each checkpoint
    program: AnyProgram
    compiled: Any  # the compiled train step
    log: MetricsLog
    windows: Any  # spmd.io.data.TokenWindows, or a spmd.io.mixture.Mixture of several
    token_file: Any  # what the data state records: a spmd.io.tokens.TokenFile's .fingerprint
    manager: Any  # orbax CheckpointManager, None without --checkpoint-dir
    stop: Any  # spmd.training.job.AgreedStop: the step every process stops after
    observer: Any = None  # spmd.observe.observer.Observer
    guard: Any = None  # spmd.training.divergence.Guard (made from `train` when None)
    # lr_factor -> the train step compiled with the LR schedule x lr_factor (for rollbacks)
    recompile: Callable[[float], Any] | None = None
    # named eval sets (--eval-data, a mixture's sources' held-out windows): name -> windows
    eval_sets: dict[str, Any] = dataclasses.field(default_factory=dict)
    heartbeat: Any = None  # spmd.training.job.Heartbeat: touched after every step
    # --sample-every: sampler(step, state) samples the prompts from the state's params
    sampler: Callable[[int, dict[str, Any]], None] | None = None
    # --eval-harness-every: (params, step) -> lm-eval's scores, logged (spmd.run.lm_eval_bridge)
    harness_eval: Callable[[Any, int], Any] | None = None

    @property
    def evaluates(self) -> bool:
        return bool(self.windows.n_eval or self.eval_sets)


@dataclasses.dataclass
class Progress:
    """Step timing and the train records of logged steps. Every step is timed when its
    metrics arrive (spmd.training.step_clock: a step that includes an eval, a save, a compile
    or a profile's start is marked so); a --profile trace's start and stop are taken out."""

    run: Run
    first_step: int
    last: dict[str, Any] = dataclasses.field(default_factory=dict)  # the newest train record

    def __post_init__(self) -> None:
        self.schedules: dict[float, Any] = {}  # by the LR factor of rollbacks
        self.tokens_per_step = self.run.cfg.run.batch * self.run.cfg.run.seq_len
        self.clock = StepClock(self.first_step)
        self.passes = epochs.passes(self.run.windows, self.run.cfg.run.batch)

    def pause(self, seconds: float) -> None:
        """Leave `seconds` of host work (a profile trace's start or stop) out of the step."""
        if seconds:
            self.clock.include("profile")
        self.clock.pause(seconds)

    def restart_clock(self) -> None:
        self.clock.restart()

    def rewind(self, step: int) -> None:
        """Go on timing from `step`, where a rollback restarts."""
        self.clock.rewind(step)

    def schedule(self, lr_factor: float) -> Any:
        """The LR schedule that the train step runs, with the LR factor of rollbacks."""
        from spmd.engine.optim import lr_schedule

        if lr_factor not in self.schedules:
            cfg = self.run.cfg
            optimizer = dataclasses.replace(cfg.optimizer, lr=cfg.optimizer.lr * lr_factor)
            self.schedules[lr_factor] = lr_schedule(optimizer, cfg.run.steps, cfg.run.batch)
        return self.schedules[lr_factor]

    def report(self, step: int, metrics: dict) -> dict[str, Any]:
        """Write the train record and progress line of a step from its metrics (fetched here
        if still on the device)."""

        observer = self.run.observer
        metrics = jax.device_get(metrics)
        if step not in self.clock.times:  # settle times every step as its metrics arrive
            self.clock.tick(step)
        step_time = self.clock.times[step]
        schedule = self.schedule(self.run.guard.lr_factor)
        record = train_record(step, metrics, step_time, schedule, self.tokens_per_step)
        record["step_includes"] = self.clock.includes[step]
        if observer is not None:
            record.update(observer.step_fields(step_time))
        if hasattr(self.run.windows, "source_tokens"):  # a mixture: tokens of each source
            record["source_tokens"] = self.run.windows.source_tokens(step)
        # passes over the data: the windows read through this step's data step / W
        record["epoch"] = round(self.passes.epoch(self.run.guard.data_step(step) + 1), 6)
        self.run.log.write("train", **record)
        loss, grad_norm, rate = record["loss"], record["grad_norm"], record["tokens_per_s"]
        line = progress_line(step, self.run.cfg.run.steps, loss, grad_norm, step_time, rate)
        if self.run.cfg.run.epochs:
            line += f" | epoch {record['epoch']:.2f}/{self.run.cfg.run.epochs}"
        if observer is not None:
            line += throughput_text(record)
        if self.run.cfg.precision.precision == "fp16":
            line += f" | loss scale {record['loss_scale']:g}, {record['skipped_steps']} skipped"
        say(line)
        self.last = record
        return record


def evaluated(run: Run, state: dict[str, Any]) -> Any:
    """The params the evals and the harness read: the state's, or its optimizer's params to
    evaluate (schedule-free AdamW's average, Program.evaluated_params; a DiLoCo program has
    none: refused with such an optimizer)."""
    of = getattr(run.program, "evaluated_params", None)
    return of(state) if of is not None else state["params"]


def save_checkpoint(run: Run, step: int, state: dict[str, Any], reason: str) -> bool:
    """Save `state` at `step` with the data state and config (async; returns once queued), or
    refuse (and report) when the step was not finite. Returns whether it saved."""
    from spmd import lora_base
    from spmd.io import checkpoint, state_check

    refusal = run.guard.refusal(step)
    if refusal is not None:
        run.log.write("checkpoint_refused", step=step, reason=refusal)
        say(f"checkpoint of step {step} not saved: {refusal}; the earlier ones are kept")
        return False
    data_state = run_data_state(run.cfg, step, run.token_file.fingerprint)
    data_state.update(run.guard.saved_fields(step))
    # a LoRA run onto an --init-from-hf base saves its adapters and a reference to the base
    view = lora_base.saved_state(run.cfg, run.program.checkpoint_view(state))
    data_state[state_check.NORMS] = state_check.state_norms(view)  # what a restore must find
    blocked = checkpoint.save(
        run.manager,
        step,
        view,
        data_state,
        lora_base.config_record(run.cfg),
    )
    run.log.write("checkpoint", step=step, reason=reason, blocking_s=blocked)
    return True


def settle(
    run: Run, progress: Progress, due: list[tuple[int, Any]], params: Any, report_last: bool
) -> divergence.Response:
    """Fetch and check the metrics of the `due` steps, oldest first (`params`, when not None,
    are the newest step's, about to be saved); write the train record of logged steps, of the
    newest when `report_last`, and of a step that diverged. The first divergence the policy acts
    on ends it with the guard's response."""

    guard = run.guard
    for step, metrics in due:
        newest = step == due[-1][0]
        metrics = jax.device_get(metrics)
        progress.clock.tick(step)
        anomaly = guard.check(step, metrics, params if newest else None)
        acting = anomaly is not None and run.cfg.divergence.on_divergence != "ignore"
        logged = (
            step % run.cfg.observe.log_every == 0
            or step == run.cfg.run.steps
            or (newest and report_last)
        )
        if logged or acting:
            progress.report(step, metrics)
        if anomaly is not None:
            response = guard.respond(run, anomaly)
            if response.action != "continue":
                return response
    return divergence.Response("continue")


def run_step(
    run: Run, progress: Progress, state: dict[str, Any], step: int
) -> tuple[dict[str, Any], Any]:
    """Dispatch optimizer step `step` on its batch: (the new state, its metrics on the device)."""
    observer = run.observer
    data_step = run.guard.data_step(step)
    sharding = run.program.layout.batch_sharding()
    batch = run.windows.batch_at(run.cfg.run.seed, data_step, run.cfg.run.batch, sharding)
    extra = {}
    if observer is not None:  # starting and reading a --profile trace is not step time
        progress.pause(observer.before_step(step, (state["params"], state["opt_state"])))
        logged = step % run.cfg.observe.log_every == 0 or step == (
            run.cfg.run.stop_after or run.cfg.run.steps
        )
        extra = observer.model_fields(step, logged, state["params"], batch)
    # --dcn-sync diloco compiles two programs: the round's last step is the synced one.
    compiled = run.compiled.for_step(step) if hasattr(run.compiled, "for_step") else run.compiled
    params, opt_state, loss_scale, metrics = compiled(
        state["params"], state["opt_state"], state["loss_scale"], batch
    )
    metrics = {**metrics, **extra}
    if observer is not None:
        progress.pause(observer.after_step(step, metrics, run.log))
    return {"params": params, "opt_state": opt_state, "loss_scale": loss_scale}, metrics


def train_loop(run: Run, state: dict[str, Any], first: int) -> int:
    """Run optimizer steps `first`..--steps from `state` (params, opt_state, loss_scale);
    returns the exit status: 0, or divergence.DIVERGED_EXIT when a divergence stopped the run.
    A rollback restores a checkpoint and goes on from the step after it."""
    run.guard = run.guard or divergence.Guard(run.cfg.divergence, run.cfg.precision.precision)
    evaluate, progress = make_evaluator(run), Progress(run, first)
    eval_loss, stop_reason, saved = None, None, False
    pending: tuple[int, dict] | None = None  # a step whose metrics are still on the device
    step, last = first, run.cfg.run.stop_after or run.cfg.run.steps
    if run.evaluates and run.cfg.data.eval_at_start and first == 1:
        evaluate(evaluated(run, state), 0)
        progress.restart_clock()
    while step <= last:
        state, metrics = run_step(run, progress, state, step)
        if run.heartbeat is not None:
            run.heartbeat.beat()
        # Every process stops after the same step, whichever of them got the signal, and when.
        stop_reason = (run.stop.reason if run.stop.stop_after(step) == step else None) or (
            "stop_after" if step == run.cfg.run.stop_after else None
        )
        evaluating = bool(
            run.evaluates and run.cfg.data.eval_every and step % run.cfg.data.eval_every == 0
        )
        sampling = run.sampler is not None and step % run.cfg.observe.sample_every == 0
        periodic = (
            run.cfg.checkpoint.checkpoint_every and step % run.cfg.checkpoint.checkpoint_every == 0
        )
        saving = run.manager is not None and bool(
            stop_reason or periodic or step == run.cfg.run.steps
        )
        due: list[tuple[int, dict]] = [pending] if pending else []
        pending = (step, metrics)
        if evaluating or saving or sampling or stop_reason or step == last:  # they wait anyway
            due, pending = [*due, pending], None
        # What a save would write: the master weights (the working params under bf16 / fp16).
        params = run.program.checkpoint_view(state)["params"] if saving else None
        response = settle(run, progress, due, params, report_last=bool(stop_reason))
        if response.action == "stop":
            return divergence.DIVERGED_EXIT
        if response.action == "rollback":
            assert response.state is not None  # a rollback brings the restored state
            state, step, pending = response.state, response.step + 1, None
            progress.rewind(response.step)
            continue
        if sampling:
            assert run.sampler is not None
            run.sampler(step, state)
            progress.clock.include("sample")  # the next step's time holds it: marked
        if evaluating:
            measured = evaluate(evaluated(run, state), step)
            eval_loss = eval_loss if measured is None else measured
            progress.clock.include("eval")  # the next step's time holds it: marked
            if measured is None and not stop_reason:  # cut short by a stop all processes agreed
                stop_reason, saving = run.stop.stop_now(step), run.manager is not None
        every = run.cfg.data.eval_harness_every
        if run.harness_eval is not None and every and step % every == 0 and not stop_reason:
            run.harness_eval(evaluated(run, state), step)
            progress.clock.include("eval")
        if saving:
            reason = stop_reason or ("end" if step == run.cfg.run.steps else "every")
            saved = save_checkpoint(run, step, state, reason)
            progress.clock.include("save")
        if stop_reason:
            finish_stopped(run.cfg, run.manager, run.log, step, stop_reason, saved)
            return 0
        step += 1
    if run.evaluates and (
        not run.cfg.data.eval_every or run.cfg.run.steps % run.cfg.data.eval_every
    ):
        eval_loss = evaluate(evaluated(run, state), run.cfg.run.steps)
    write_summary(run, progress, eval_loss)
    return 0


def write_summary(run: Run, progress: Progress, eval_loss: float | None) -> None:
    """The JSONL summary record and the closing line of a run that reached --steps."""
    observer = run.observer
    times = progress.clock.summary()
    median_step, tokens_per_step = float(times["median_step_time_s"]), progress.tokens_per_step
    final_loss = progress.last["loss"]
    run.log.write(
        "summary",
        steps=run.cfg.run.steps,
        final_loss=final_loss,
        eval_loss=eval_loss,
        **times,  # median_step_time_s, p90_step_time_s, timed_steps, marked_steps
        tokens_per_s=tokens_per_step / median_step,
        anomalies=run.guard.anomalies,  # diverged steps (in this process's part of the run)
        rollbacks=run.guard.rollbacks,  # over the whole run, resumes included
        skipped_data_steps=len(run.guard.skipped),
        **(observer.throughput(median_step) if observer is not None else {}),
        **epoch_counts(run),
    )
    say(
        f"done: {run.cfg.run.steps} steps, final loss {final_loss:.4f}, eval loss "
        f"{eval_loss if eval_loss is None else round(eval_loss, 4)}, median "
        f"{median_step * 1e3:.1f} ms/step, p90 {float(times['p90_step_time_s']) * 1e3:.1f} "
        f"({marked_text(times)}), {tokens_per_step / median_step:,.0f} tokens/s"
    )
    from spmd.training.run_folder import report_command

    drawn = report_command(run.cfg)
    if drawn:
        say(f"its curves: {drawn}")


def epoch_counts(run: Run) -> dict[str, Any]:
    """An --epochs run's summary fields: `epochs` (passes after the last step) and
    `windows_per_epoch` (the windows, pairs or first source's windows read in each epoch, and
    how many of them differ), counted over the whole run from the data steps it read."""
    if not run.cfg.run.epochs:
        return {}
    steps, seed, batch = run.cfg.run.steps, run.cfg.run.seed, run.cfg.run.batch
    data_steps = [run.guard.data_step(step) for step in range(1, steps + 1)]
    counts = epochs.windows_per_epoch(run.windows, seed, batch, data_steps)
    say("windows read per epoch: " + ", ".join(f"{c['epoch']}: {c['reads']}" for c in counts))
    passes = epochs.passes(run.windows, batch).epoch(data_steps[-1] + 1)
    return {"epochs": round(passes, 6), "windows_per_epoch": counts}


def marked_text(times: dict) -> str:
    """'over 46 steps; marked and left out: compile 1, eval 2, save 1' for the closing line."""
    text = f"over {times['plain_steps']} steps"
    marked = times["marked_steps"]
    return (
        text
        + ("; marked and left out: " if marked else "")
        + ", ".join(f"{w} {n}" for w, n in marked.items())
    )


def throughput_text(record: dict) -> str:
    """The progress line's tail: TFLOP/s per device, and MFU where the peak is known."""
    text = f" | {record['tflops_per_device']:.3g} TFLOP/s/device"
    return text + (f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else "")
