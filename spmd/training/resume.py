"""Resuming a run: open its checkpoints, restore the newest onto this run's mesh after checking
it continues this run, and the data state and stop message that go with a checkpoint.

The train state is a dict of named pytrees; `program_state_target` is the one place that lists
them (with this run's shardings), so new state such as a loss scale joins there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spmd import config
from spmd.config import TrainConfig
from spmd.errors import UsageError
from spmd.io import data
from spmd.log import say
from spmd.observe.metrics import MetricsLog

# Train fields that do not change what is computed: not worth a note when they differ on resume.
BOOKKEEPING_FIELDS = (
    "resume",
    "stop_after",
    "checkpoint_dir",
    "checkpoint_every",
    "keep_checkpoints",
    "on_divergence",
    "spike_threshold",
    "spike_window",
    "max_rollbacks",
    "rollback_lr_factor",
    "metrics",
    "log_every",
    "data_cache",
)


def open_checkpoints(
    train: TrainConfig, program: Any, sections: dict[str, Any], fingerprint: str
) -> tuple[Any, Any]:
    """(the checkpoint manager, the restored checkpoint or None): with --resume, the newest
    readable checkpoint, read onto this run's mesh, after checking it continues this run."""
    from spmd.io import checkpoint

    manager = checkpoint.open_manager(train.checkpoint_dir, train.keep_checkpoints)
    if not train.resume:
        return manager, None
    try:
        restored = checkpoint.restore_newest(
            manager, program_state_target(program), dataclasses.asdict(sections["model"]), say
        )
        current = run_data_state(train, restored.step, fingerprint)
        data.check_same_order(restored.data, current)
        if restored.data.get("diloco") != current.get("diloco"):
            raise UsageError(
                f"the checkpoint's outer loop {restored.data.get('diloco')} differs from this "
                f"run's {current.get('diloco')}; resume with the same --dcn-sync and --sync-every"
            )
        if train.stop_after and restored.step >= train.stop_after:
            raise UsageError(
                f"--stop-after {train.stop_after} is not after step {restored.step}, where the "
                f"checkpoint in {train.checkpoint_dir} resumes; give a later step or 0"
            )
    except BaseException:
        manager.close()
        raise
    saved_train = restored.config.get("train", {})
    say(
        f"resumed from step {restored.step} in {train.checkpoint_dir} (saved on mesh "
        f"{saved_train.get('mesh', '?')}, now on mesh {train.mesh})"
    )
    changed = [
        f"{config.flag_name(k)} {saved_train[k]!r} -> {v!r}"
        for k, v in dataclasses.asdict(train).items()
        if k in saved_train and saved_train[k] != v and k not in BOOKKEEPING_FIELDS
    ]
    if changed:
        say(f"changed since the checkpoint was saved: {', '.join(changed)}")
    return manager, restored


def program_state_target(program: Any) -> dict[str, Any]:
    """What a checkpoint holds (params = the fp32 master weights, the optimizer's own state,
    the loss scale) as ShapeDtypeStructs with this run's shardings."""
    return program.abstract_checkpoint()


def run_data_state(train: TrainConfig, step: int, fingerprint: str) -> dict[str, Any]:
    """The data state after `step` optimizer steps; under --dcn-sync diloco also H and the
    position within the round (inner steps since the last sync), which a resume must match."""
    state = data.data_state(
        step, train.seed, train.batch, train.seq_len, train.eval_fraction, fingerprint
    )
    if train.dcn_sync == "diloco":
        position = step % train.sync_every
        state["diloco"] = {"sync_every": train.sync_every, "round_position": position}
    return state


def finish_stopped(
    train: TrainConfig, manager: Any, log: MetricsLog, step: int, reason: str, saved: bool = True
) -> None:
    """Wait for the stop's checkpoint to be written, then say how to continue. `saved` is False
    when the step's state was not finite, so its checkpoint was refused."""
    if manager is None:
        log.write("stopped", step=step, reason=reason, checkpoint=None)
        say(f"stopped after step {step} ({reason}); no --checkpoint-dir, so nothing was saved")
        return
    manager.wait_until_finished()
    log.write("stopped", step=step, reason=reason, checkpoint=train.checkpoint_dir)
    what = (
        f"checkpoint saved in {train.checkpoint_dir}"
        if saved
        else f"its state was not finite, so not saved: {train.checkpoint_dir} keeps older steps"
    )
    say(
        f"stopped after step {step} ({reason}); {what}; continue with the same command and --resume"
    )
