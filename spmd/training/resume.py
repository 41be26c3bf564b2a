"""Resuming a run: open its checkpoints, restore the newest onto this run's mesh after checking
it continues this run, and the data state and stop message that go with a checkpoint.

The train state is a dict of named pytrees; `program_state_target` is the one place that lists
them (with this run's shardings), so new state such as a loss scale joins there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spmd import sections
from spmd.errors import UsageError
from spmd.io import data
from spmd.log import say
from spmd.observe.metrics import MetricsLog
from spmd.sections import Config

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyProgram

# The data state's key of the order --epochs reads (absent: the order of --steps)
ORDER, STREAM = "order", "epochs"

# Train fields that do not change what is computed: not worth a note when they differ on resume.
BOOKKEEPING_FIELDS = (
    "resume",
    "allow_unverified",
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
    "tensorboard",
    "profile",
    "profile_dir",
    "run_dir",
    "run_name",
    "tracker",
    "log_level",
    "log_every",
    "data_cache",
)


def open_checkpoints(
    cfg: Config, program: AnyProgram, fingerprint: str, resumes: bool
) -> tuple[Any, Any]:
    """(the checkpoint manager, the restored checkpoint or None): when the run `resumes`
    (spmd.run.checks.checkpoint_resumes), the newest readable checkpoint, read onto this run's mesh,
    after checking it continues this run."""
    from spmd import lora_base
    from spmd.engine import fp8_state
    from spmd.io import checkpoint, checkpoint_restore

    manager = checkpoint.open_manager(
        cfg.checkpoint.checkpoint_dir, cfg.checkpoint.keep_checkpoints
    )
    if not resumes:
        return manager, None
    try:
        restored = checkpoint_restore.restore_newest(
            manager,
            lora_base.restore_target(cfg, program),
            dataclasses.asdict(cfg.model),
            say,
            cfg.checkpoint.allow_unverified,
            fp8_state.CHECKPOINT_OPTIONAL,
            lambda saved, where: check_settings(cfg, saved, where),
        )
        restored.state = lora_base.with_base(cfg, program, restored)  # LoRA: reload the base
        current = run_data_state(cfg, restored.step, fingerprint)
        data.check_same_order(restored.data, current)
        if restored.data.get(ORDER) != current.get(ORDER):
            now, then = ("--epochs", "--steps") if cfg.run.epochs else ("--steps", "--epochs")
            raise UsageError(
                f"the checkpoint was trained with {then}, whose data order differs from "
                f"{now}'s; resume it with {then}"
            )
        if restored.data.get("diloco") != current.get("diloco"):
            raise UsageError(
                f"the checkpoint's outer loop {restored.data.get('diloco')} differs from this "
                f"run's {current.get('diloco')}; resume with the same --dcn-sync and --sync-every"
            )
        if cfg.run.stop_after and restored.step >= cfg.run.stop_after:
            raise UsageError(
                f"--stop-after {cfg.run.stop_after} is not after step {restored.step}, where the "
                f"checkpoint in {cfg.checkpoint.checkpoint_dir} resumes; give a later step or 0"
            )
    except BaseException:
        manager.close()
        raise
    saved = sections.flat_values(restored.config)
    say(
        f"resumed from step {restored.step} in {cfg.checkpoint.checkpoint_dir} (saved on mesh "
        f"{saved.get('mesh', '?')}, now on mesh {cfg.parallel.mesh})"
    )
    changed = [
        f"{sections.flag_name(k)} {saved[k]!r} -> {v!r}"
        for section in cfg.sections().values()
        if section is not cfg.model
        for k, v in dataclasses.asdict(section).items()
        if k in saved and saved[k] != v and k not in BOOKKEEPING_FIELDS
    ]
    if changed:
        say(f"changed since the checkpoint was saved: {', '.join(changed)}")
    return manager, restored


def with_saved_template(cfg: Config) -> Config:
    """Run `cfg`, resuming from its --checkpoint-dir, with the chat template its newest
    checkpoint was trained with (saved there as text, spmd.io.templates): adopted where the run
    gives none; UsageError where it gives another (the tokens would not be the same)."""
    import json

    from spmd import paths
    from spmd.io import checkpoint, templates, tokens

    directory = cfg.checkpoint.checkpoint_dir
    steps = checkpoint.complete_steps(directory)
    # The saved config's JSON read as a file, not through orbax: this runs before the mesh,
    # and orbax's restore starts JAX (a multi-process job, or --devices, needs it unstarted).
    config_file = paths.epath(directory) / str(steps[-1]) / checkpoint.CONFIG / "metadata"
    try:
        saved = json.loads(config_file.read_text()) if steps else {}
    except (OSError, ValueError):
        return cfg  # an unreadable config: the restore names the problem after the mesh
    text = saved.get(templates.SAVED_KEY)
    if not isinstance(text, str):
        return cfg
    given = cfg.data.chat_template
    if given:
        if templates.source(given) != text:
            raise UsageError(
                f"--chat-template {given} is not the chat template the checkpoint in {directory} "
                f"was trained with (saved in it); resume without --chat-template to use that one"
            )
        return cfg
    cache = Path(cfg.data.data_cache) if cfg.data.data_cache else tokens.default_cache_dir()
    named = str(sections.flat_values(saved).get("chat_template", ""))
    value = templates.adopted(named, text, cache)
    say(f"resuming with the checkpoint's chat template (--chat-template {value})")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, chat_template=value))


def check_settings(cfg: Config, saved_config: dict[str, Any], where: str) -> None:
    """UsageError for a checkpoint (its saved config; `where` names its step and folder) that
    run `cfg` cannot continue, naming the flags that resume it: other LoRA adapters
    (spmd.lora_base), another optimizer's state (spmd.engine.optimizers)."""
    from spmd import lora_base
    from spmd.engine import optimizers

    lora_base.check_settings(cfg, saved_config, where)
    optimizers.check_resume(cfg.optimizer.optimizer, sections.flat_values(saved_config), where)


def program_state_target(program: AnyProgram) -> dict[str, Any]:
    """What a checkpoint holds (params = the fp32 master weights, the optimizer's own state,
    the loss scale) as ShapeDtypeStructs with this run's shardings."""
    return program.abstract_checkpoint()


def run_data_state(cfg: Config, step: int, fingerprint: str) -> dict[str, Any]:
    """The data state after `step` optimizer steps; under --dcn-sync diloco also H and the
    position within the round (inner steps since the last sync), which a resume must match."""
    state = data.data_state(
        step, cfg.run.seed, cfg.run.batch, cfg.run.seq_len, cfg.data.eval_fraction, fingerprint
    )
    if cfg.run.epochs:  # one stream of epochs (spmd.io.epochs), not the order of --steps
        state[ORDER] = STREAM
    if cfg.parallel.dcn_sync == "diloco":
        position = step % cfg.parallel.sync_every
        state["diloco"] = {"sync_every": cfg.parallel.sync_every, "round_position": position}
    return state


def finish_stopped(
    cfg: Config, manager: Any, log: MetricsLog, step: int, reason: str, saved: bool = True
) -> None:
    """Wait for the stop's checkpoint to be written, then say how to continue. `saved` is False
    when the step's state was not finite, so its checkpoint was refused."""
    if manager is None:
        log.write("stopped", step=step, reason=reason, checkpoint=None)
        say(f"stopped after step {step} ({reason}); no --checkpoint-dir, so nothing was saved")
        return
    manager.wait_until_finished()
    folder = cfg.checkpoint.checkpoint_dir
    log.write("stopped", step=step, reason=reason, checkpoint=cfg.checkpoint.checkpoint_dir)
    what = (
        f"checkpoint saved in {folder}"
        if saved
        else f"its state was not finite, so not saved: {folder} keeps older steps"
    )
    from spmd.training.run_folder import continue_command

    say(f"stopped after step {step} ({reason}); {what}; to continue: {continue_command(cfg)}")
