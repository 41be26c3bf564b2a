"""Params alone in and out of spmd checkpoints: for generation, export, and converted weights.

Any checkpoint folder of spmd.io.checkpoint (a training run's, or one written by `spmd.convert
--from-hf`) can give back its params without its optimizer state: `saved_config` reads the
config item (which says what model to build) and `restore_params` reads only the `params`
subtree of the state item (its `eval_params` where it has them: schedule-free AdamW's
average), straight into the shardings of the current mesh.

A converted checkpoint is an ordinary checkpoint folder with one step, 0 (no optimizer step
done), whose state holds only `params`: a Hugging Face model has no optimizer or data state, and
a fresh AdamW state is zeros that training makes itself. Its config says where the weights came
from (CONVERTED_FROM), and `refuse_resume` turns `spmd.train` resuming from such a folder into a
clear error: there is no run to continue, and a run writing into the folder would delete the
converted weights as its checkpoints rotate. Train from the weights with `--init-from-hf`.

Before reading a step, `verify_step` checks it against its manifest (spmd.io.manifest). A step
that fails is reported, not moved aside as `spmd.train --resume` does: generate and convert only
read the folder, which may be read-only or belong to a run still training (whose manager would
not expect its steps to vanish), so the person decides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from spmd.errors import UsageError
from spmd.io import checkpoint, checkpoint_shapes, manifest, stray_reads
from spmd.log import warn

CONVERTED_FROM = "converted_from"  # config key of a converted checkpoint: the source folder
CONVERTED_STEP = 0
# the state item's params to evaluate and export, where the optimizer trains others
# (schedule-free AdamW: its average x; spmd.engine.step.Program.checkpoint_view)
EVAL_PARAMS = "eval_params"


def pick_step(directory: str, step: int = 0) -> int:
    """`step` if `directory` holds it complete, or the newest complete step when step is 0 (a
    converted checkpoint's only step is 0 too); UsageError otherwise."""
    steps = checkpoint.complete_steps(directory)
    if not steps:
        raise UsageError(
            f"--checkpoint {directory} holds no complete checkpoint; give the --checkpoint-dir "
            f"of a training run or the --to folder of spmd.convert"
        )
    if step and step not in steps:
        raise UsageError(f"--step {step} is not in {directory}; it holds steps {steps}")
    return step or steps[-1]


def verify_step(directory: str, step: int) -> None:
    """UsageError naming the file when checkpoint `step` of `directory` fails its manifest; a
    line on stderr when it has none, and it is read unverified."""
    verdict = manifest.verify(Path(directory) / str(step))
    if verdict.status == "damaged":
        raise UsageError(
            f"{directory} step {step} is damaged: {verdict.file} {verdict.why}; give an older "
            f"--step, after checking them with python -m spmd.checkpoint verify {directory}"
        )
    if verdict.status == "unverified":
        warn(f"{directory} step {step} has {verdict.why}: reading it unverified")


def saved_config(directory: str, step: int) -> dict[str, Any]:
    """The run config saved with checkpoint `step` of `directory` ({"model": ..., ...})."""
    path = Path(directory).absolute() / str(step) / checkpoint.CONFIG
    try:
        return dict(ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path))
    except Exception as e:  # orbax raises many types for unreadable files
        raise UsageError(
            f"{directory} step {step}: cannot read its config ({checkpoint.error_line(e)})"
        ) from None


def restore_params(directory: str, step: int, abstract_params: Any) -> Any:
    """The `params` of checkpoint `step`, read into `abstract_params` (ShapeDtypeStructs with
    the current shardings) without reading the optimizer state; UsageError naming the first
    param whose shape differs."""
    path = Path(directory).absolute() / str(step) / checkpoint.STATE
    try:
        saved = ocp.PyTreeCheckpointHandler().metadata(path).tree
    except Exception as e:
        raise UsageError(
            f"{directory} step {step}: cannot read its state ({checkpoint.error_line(e)})"
        ) from None
    # a schedule-free run's checkpoint holds the params to evaluate beside its train state's
    key = EVAL_PARAMS if EVAL_PARAMS in saved else "params"
    _check_shapes(saved.get(key, {}), abstract_params, f"{directory} step {step}")
    target = {key: abstract_params}
    stray_reads.quiet_stray_reads()  # a failed read's others would print tracebacks
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            ),
        )
    except Exception as e:  # a step without a manifest whose files are damaged
        raise UsageError(
            f"{directory} step {step}: cannot read its params ({checkpoint.error_line(e)})"
        ) from None
    return restored[key]


def _check_shapes(saved: Any, abstract_params: Any, where: str) -> None:
    want = checkpoint_shapes.tree_shapes(abstract_params)
    have = checkpoint_shapes.tree_shapes(saved)
    difference = checkpoint_shapes.shape_difference(have, want)
    if difference is None:
        return
    name, kind = difference
    if kind == "missing":
        raise UsageError(f"{where} has no param {name}, which the model of its config has")
    if kind == "extra":
        raise UsageError(f"{where} holds param {name}, which the model of its config lacks")
    raise UsageError(
        f"{where} holds param {name} with shape {have[name]}, but the model of its "
        f"config has shape {want[name]}"
    )


def save_converted(directory: str, params: Any, config: dict[str, Any], source: str) -> None:
    """Write `params` as checkpoint step 0 of the new checkpoint folder `directory`, with
    `config` (e.g. {"model": ...}) marked as converted from `source`. Refuses a folder that
    already holds checkpoints."""
    steps = checkpoint.complete_steps(directory)
    if steps:  # written by another conversion since the command began
        raise UsageError(
            f"--to {directory} already holds checkpoints (newest: step {steps[-1]}); give a new "
            f"folder"
        )
    manager = checkpoint.open_manager(directory, keep=1)
    try:
        checkpoint.save(
            manager,
            CONVERTED_STEP,
            {"params": params},
            {CONVERTED_FROM: source},
            {**config, CONVERTED_FROM: source},
        )
    finally:
        manager.close()


def refuse_resume(directory: str) -> None:
    """UsageError if the newest checkpoint of `directory` holds converted weights."""
    steps = checkpoint.complete_steps(directory)
    if not steps or steps[-1] != CONVERTED_STEP:
        return
    source = saved_config(directory, steps[-1]).get(CONVERTED_FROM)
    if source is not None:
        raise UsageError(
            f"--checkpoint-dir {directory} holds weights converted from {source} (params only, no "
            f"optimizer or data state), not a run to continue; train from them with "
            f"--init-from-hf {source} and a new --checkpoint-dir"
        )
