"""What a run does when its loss diverges: notice it on every step, then stop, roll back or go on.

Detection reads each step's loss and gradient norm from the metrics the loop fetches anyway, one
step late (spmd.training.loop.settle), so it adds no synchronisation. A step diverged when

    its loss is not finite;
    its gradient norm is not finite, outside --precision fp16 (whose loss scale skips such a
        step and halves itself: that is its own remedy, not a divergence);
    its params are not finite (checked only before a save, which waits for the step anyway);
    with --spike-threshold K, its loss is above K x the median of the last --spike-window finite
        losses (at least MIN_SPIKE_HISTORY of them).

What follows is --on-divergence:

    stop      (default) save nothing more and exit with status DIVERGED_EXIT (3), naming the
              newest checkpoint, which is finite, to resume from
    rollback  restore the newest checkpoint in-process and skip the data windows of every step
              it undoes (checkpoint step + 1 through the diverged step), multiply the LR schedule
              by --rollback-lr-factor, and go on; after --max-rollbacks rollbacks, as `stop`
    ignore    report and go on

Step k's loss is the loss of the params after step k - 1. So when step k diverges, a checkpoint
of step k - 1 holds the params that diverged: `stop` and `rollback` first move it aside to
`<k-1>.diverged` (kept, never read again), and the newest checkpoint left is one whose params
were seen to train on with a finite loss. Why every undone window is skipped, not only the
diverged step's: every step is deterministic, so replaying the same windows from the same
checkpoint would reproduce the same params bit for bit up to the step before the divergence.

Skipping keeps the data order a function of (seed, step): optimizer step t reads data step
spmd.io.data.data_step(t, skipped), and the skipped data steps, the LR factor, the rollback count
and the recent losses (the spike median's window) are saved in every checkpoint's data state, so
a resumed run reads the same windows and judges spikes as the uninterrupted run would.

Under every policy a state whose step diverged with a non-finite value is never saved. So every
checkpoint holds finite params, and keeping the newest --keep-checkpoints never deletes the newest
finite one.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import TYPE_CHECKING, Any

import jax

from spmd.errors import UsageError
from spmd.io import data
from spmd.log import say, warn
from spmd.sections import DivergenceConfig, choices

if TYPE_CHECKING:
    from spmd.training.loop import Run

DIVERGED_EXIT = 3  # exit status of a run that --on-divergence stop ended (2 is a usage error)
POLICIES = choices(DivergenceConfig, "on_divergence")
MIN_SPIKE_HISTORY = 2  # earlier finite losses a spike is measured against, at the least


def check_choices(cfg: DivergenceConfig, checkpoint_dir: str) -> None:
    """UsageError for divergence flags out of range or without what they need."""
    if cfg.on_divergence not in POLICIES:
        raise UsageError(
            f"--on-divergence {cfg.on_divergence!r} is not one of {', '.join(POLICIES)}"
        )
    threshold = cfg.spike_threshold
    if not (threshold == 0 or 1 < threshold < math.inf):
        raise UsageError(f"--spike-threshold {threshold:g} must be 0 (off) or a factor above 1")
    if cfg.spike_window < MIN_SPIKE_HISTORY:
        raise UsageError(
            f"--spike-window {cfg.spike_window} must be at least {MIN_SPIKE_HISTORY} steps"
        )
    if cfg.max_rollbacks < 0:
        raise UsageError(f"--max-rollbacks {cfg.max_rollbacks} must be 0 or more")
    if not 0 < cfg.rollback_lr_factor <= 1:
        raise UsageError(
            f"--rollback-lr-factor {cfg.rollback_lr_factor:g} must be in (0, 1] (1: keep the LR)"
        )
    if cfg.on_divergence == "rollback" and not checkpoint_dir:
        raise UsageError(
            "--on-divergence rollback needs --checkpoint-dir, the checkpoints it rolls back to"
        )


@dataclasses.dataclass(frozen=True)
class Anomaly:
    """A diverged step: what diverged ("loss", "grad_norm", "params" or "spike"), its value
    (None for params) and one phrase for people."""

    step: int
    what: str
    value: float | None
    reason: str

    @property
    def finite(self) -> bool:
        """Whether the step's state is still finite (a spike), so it could be saved."""
        return self.what == "spike"


@dataclasses.dataclass
class Response:
    """What the loop does after a step was checked: "continue", "stop", or "rollback" to
    `state`, the train state saved after step `step`."""

    action: str
    state: dict[str, Any] | None = None
    step: int = 0


class Guard:
    """The divergence policy of one run and what it has changed so far (skipped data steps, LR
    factor, rollbacks), restored from a checkpoint's data state `saved` on resume."""

    def __init__(
        self, cfg: DivergenceConfig, precision_name: str, saved: dict[str, Any] | None = None
    ) -> None:
        from spmd.engine import precision

        saved = saved or {}
        self.cfg = cfg
        self.loss_scaling = precision.get(precision_name).loss_scaling
        self.skipped: list[int] = sorted(saved.get("skipped_data_steps", []))
        self.lr_factor = float(saved.get("lr_factor", 1.0))
        self.rollbacks = int(saved.get("rollbacks", 0))
        self.history = self._history(saved)
        self.anomalies = 0  # diverged steps seen by this process
        self.unsaveable: tuple[int, str] | None = None  # the newest non-finite step, and why
        self.last_loss: tuple[int, float] | None = None
        self._previous_anomaly = -1
        self._all_finite: Any = None

    def _history(self, saved: dict[str, Any]) -> collections.deque:
        """The recent (step, finite loss) pairs the spike median is taken over."""
        pairs = [(int(s), float(loss)) for s, loss in saved.get("recent_losses", [])]
        return collections.deque(pairs, maxlen=self.cfg.spike_window)

    def data_step(self, step: int) -> int:
        """The data step optimizer step `step` (1-based) reads."""
        return data.data_step(step, self.skipped)

    def saved_fields(self, step: int) -> dict[str, Any]:
        """What a checkpoint after `step` records of the policy's state (JSON-ready)."""
        loss = self.last_loss[1] if self.last_loss and self.last_loss[0] == step else None
        return {
            "loss": loss,  # of the step the checkpoint was saved after
            "skipped_data_steps": list(self.skipped),
            "lr_factor": self.lr_factor,
            "rollbacks": self.rollbacks,
            "recent_losses": [[s, loss] for s, loss in self.history],
        }

    def check(self, step: int, metrics: dict[str, Any], params: Any = None) -> Anomaly | None:
        """The anomaly of `step` from its fetched metrics and, before a save, its `params`
        (device arrays, checked on the device), or None when it did not diverge."""
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        self.last_loss = (step, loss)
        anomaly = None
        if not math.isfinite(loss):
            anomaly = Anomaly(step, "loss", loss, f"loss {loss}")
        elif not math.isfinite(grad_norm) and not self.loss_scaling:
            anomaly = Anomaly(step, "grad_norm", grad_norm, f"gradient norm {grad_norm}")
        elif params is not None and not self._params_finite(params):
            anomaly = Anomaly(step, "params", None, "params not all finite")
        elif (median := self._spike_median(loss)) is not None:
            reason = (
                f"loss {loss:.4g} above {self.cfg.spike_threshold:g} x {median:.4g}, the "
                f"median of the last {len(self.history)} losses"
            )
            anomaly = Anomaly(step, "spike", loss, reason)
        if anomaly is None:
            self.history.append((step, loss))
            return None
        self.anomalies += 1
        if not anomaly.finite:
            self.unsaveable = (step, anomaly.reason)
        return anomaly

    def refusal(self, step: int) -> str | None:
        """Why the state after `step` must not be saved (it is not finite), or None."""
        if self.unsaveable is not None and self.unsaveable[0] == step:
            return self.unsaveable[1]
        return None

    def _spike_median(self, loss: float) -> float | None:
        """The median `loss` is a spike against, or None."""
        if not self.cfg.spike_threshold or len(self.history) < MIN_SPIKE_HISTORY:
            return None
        median = statistics.median(value for _, value in self.history)
        return median if loss > self.cfg.spike_threshold * median else None

    def _params_finite(self, params: Any) -> bool:

        from spmd.engine import precision

        if self._all_finite is None:  # compiled once, on the first save
            # Replicated, so that every process of a multi-process job can read the answer.
            mesh = jax.tree.leaves(params)[0].sharding.mesh
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._all_finite = jax.jit(precision.all_finite, out_shardings=replicated)
        return bool(self._all_finite(params))

    def respond(self, run: Run, anomaly: Anomaly) -> Response:
        """Report the anomaly (console and the JSONL "anomaly" record) and act on it by
        --on-divergence. `run` is the loop's spmd.training.loop.Run."""
        policy = self.cfg.on_divergence
        if policy == "ignore":
            # One console line per streak of diverged steps; the JSONL gets every one.
            quiet = anomaly.step == self._previous_anomaly + 1
            self._previous_anomaly = anomaly.step
            self._report(run, anomaly, "ignore", self.data_step(anomaly.step), quiet=quiet)
            return Response("continue")
        set_aside = self._set_aside_diverged(run, anomaly)
        why_not = self._why_no_rollback(run) if policy == "rollback" else None
        if policy == "rollback" and why_not is None:
            return self._roll_back(run, anomaly, set_aside)
        return self._stop(run, anomaly, why_not, set_aside)

    def _set_aside_diverged(self, run: Run, anomaly: Anomaly) -> str | None:
        """Move a checkpoint of the step before `anomaly` (whose params diverged) aside; the
        path it went to, or None."""
        if newest_checkpoint(run) != anomaly.step - 1:
            return None
        from spmd.io import checkpoint

        target = checkpoint.set_aside(run.manager, anomaly.step - 1, checkpoint.DIVERGED_SUFFIX)
        say(
            f"checkpoint of step {anomaly.step - 1} holds the params that diverged at step "
            f"{anomaly.step}: moved it to {target}"
        )
        return str(target)

    def _report(
        self, run: Run, anomaly: Anomaly, action: str, data_step: int, quiet: bool = False, **more
    ) -> None:
        run.log.write(
            "anomaly",
            step=anomaly.step,
            data_step=data_step,
            what=anomaly.what,
            value=anomaly.value,
            reason=anomaly.reason,
            action=action,
            **more,
        )
        if not quiet:
            say(f"divergence at step {anomaly.step}: {anomaly.reason} (--on-divergence {action})")

    def _why_no_rollback(self, run: Run) -> str | None:
        if self.rollbacks >= self.cfg.max_rollbacks:
            return f"{self.rollbacks} rollbacks already (--max-rollbacks {self.cfg.max_rollbacks})"
        if newest_checkpoint(run) is None:
            return "no checkpoint to roll back to yet"
        return None

    def _stop(
        self, run: Run, anomaly: Anomaly, why_not: str | None, set_aside: str | None
    ) -> Response:
        """Save nothing more; one line naming the step and the checkpoint to resume from."""
        newest = newest_checkpoint(run)
        folder = run.cfg.checkpoint.checkpoint_dir
        self._report(
            run,
            anomaly,
            "stop",
            self.data_step(anomaly.step),
            checkpoint_step=newest,
            set_aside=set_aside,
            no_rollback=why_not,
        )
        run.log.write(
            "stopped",
            step=anomaly.step,
            reason="diverged",
            checkpoint=folder or None,
            checkpoint_step=newest,
        )
        where = (
            f"its newest checkpoint, step {newest} in {folder}, is finite: the same command "
            f"continues from it (--resume auto); give it a lower --lr or --on-divergence rollback"
            if newest is not None
            else "no checkpoint was saved before it: start again with a lower --lr"
        )
        because = f" ({why_not})" if why_not else ""
        warn(
            f"diverged at step {anomaly.step} ({anomaly.reason}){because}; stopped without "
            f"saving (exit status {DIVERGED_EXIT}); {where}"
        )
        _leave_together(anomaly.step)
        return Response("stop")

    def _roll_back(self, run: Run, anomaly: Anomaly, set_aside: str | None) -> Response:
        """Restore the newest checkpoint, skip the windows of the steps it undoes, scale the LR."""
        from spmd import lora_base
        from spmd.engine import fp8_state
        from spmd.io import checkpoint_restore

        data_step = self.data_step(anomaly.step)
        restored = checkpoint_restore.restore_newest(
            run.manager,
            lora_base.restore_target(run.cfg, run.program),
            dataclasses.asdict(run.cfg.model),
            say,
            run.cfg.checkpoint.allow_unverified,
            fp8_state.CHECKPOINT_OPTIONAL,
        )
        undone = [self.data_step(t) for t in range(restored.step + 1, anomaly.step + 1)]
        saved = restored.data.get("skipped_data_steps", [])
        self.skipped = sorted({*self.skipped, *saved, *undone})
        self.rollbacks += 1
        self.history = self._history(restored.data)
        factor = self.lr_factor * self.cfg.rollback_lr_factor
        if factor != self.lr_factor:
            assert run.recompile is not None  # spmd.train gives every run one
            run.compiled = run.recompile(factor)  # the LR schedule is compiled into the step
            self.lr_factor = factor
        self._report(
            run,
            anomaly,
            "rollback",
            data_step,
            restored_step=restored.step,
            set_aside=set_aside,
            skipped_data_steps=undone,
            lr_factor=self.lr_factor,
            rollbacks=self.rollbacks,
        )
        say(
            f"rolled back to the checkpoint of step {restored.step} (rollback {self.rollbacks} of "
            f"at most {self.cfg.max_rollbacks}); skipping data steps {undone[0]}-{undone[-1]}, "
            f"LR x{self.lr_factor:g}"
        )
        whole = lora_base.with_base(run.cfg, run.program, restored)  # LoRA: the base reloaded
        state = run.program.from_checkpoint(whole)._asdict()  # working params too
        return Response("rollback", state, restored.step)


def _leave_together(step: int) -> None:
    """Wait until every process has decided to stop: a process that exits first (non-zero
    exits skip JAX's shutdown barrier) would cut off the others' last lines, process 0's own."""

    if jax.process_count() > 1:
        from orbax.checkpoint import multihost

        multihost.sync_global_processes(f"spmd_diverged_stop_{step}")


def newest_checkpoint(run: Run) -> int | None:
    """The newest complete checkpoint's step once every save in flight is written, or None."""
    if run.manager is None:
        return None
    from spmd.io import checkpoint

    run.manager.wait_until_finished()
    steps = checkpoint.complete_steps(run.cfg.checkpoint.checkpoint_dir)
    return steps[-1] if steps else None
