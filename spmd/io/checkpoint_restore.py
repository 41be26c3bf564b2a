"""Restore the newest step of a checkpoint folder that is whole and plausible, falling back
past damage (spmd.io.checkpoint's text): each step is checked against its manifest (the same
verdict on every process), its shapes against the model's, and what it restores against the
norms saved with it; a step that fails is set aside with one line, never deleted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from spmd.errors import UsageError
from spmd.io import checkpoint_shapes as shapes
from spmd.io import manifest, state_check
from spmd.io.checkpoint import (
    CONFIG,
    DAMAGED_SUFFIX,
    DATA,
    STATE,
    UNVERIFIED_SUFFIX,
    Restored,
    error_line,
    set_aside,
)
from spmd.io.stray_reads import quiet_stray_reads


def restore_newest(
    manager: ocp.CheckpointManager,
    abstract_state: dict[str, Any],
    model_config: dict[str, Any],
    say: Callable[[str], None],
    allow_unverified: bool = False,
    optional: Mapping[str, tuple[str, str]] | None = None,
    check_config: Callable[[dict[str, Any], str], None] | None = None,
) -> Restored:
    """Restore the newest verified, readable and plausible checkpoint into `abstract_state`
    (ShapeDtypeStructs with the current shardings). A damaged step (one that fails its
    manifest, cannot be read, or restores to values unlike those saved: spmd.io.state_check)
    is moved aside (`say` tells why, in one line) and the next older one is tried; so is a step
    without a manifest when an older one has one, unless `allow_unverified`. UsageError if the
    shapes differ from the model's or no step can be read.

    `optional` names state entries ("loss_scale/fp8") that belong to one setting of the run,
    with the lines to say (formatted with {step}) when the checkpoint lacks one that
    `abstract_state` holds, and when it holds one that `abstract_state` lacks: the first is
    left out of the restored state (the caller starts it fresh), the second is read, so that
    the saved norms check all that was saved, and then dropped.

    `check_config(saved config, "the checkpoint at step S in DIR")` raises UsageError for a
    checkpoint whose saved settings this run cannot continue (LoRA's: spmd.lora_base); it runs
    before the shapes are compared, so that its line, naming the flags, is the one said."""
    optional = optional or {}
    quiet_stray_reads()  # before any read: the stray ones come back after the failing one
    manager.wait_until_finished()  # a rollback's newest step may still be getting its manifest
    directory = manager.directory
    steps = sorted(manager.all_steps(), reverse=True)
    problems = []
    for step in steps:
        verdict = agreed_verdict(directory / str(step))
        if verdict.status == "damaged":
            problems.append(_set_aside(manager, step, f"{verdict.file} {verdict.why}", say))
            continue
        if verdict.status == "unverified":
            older = [
                s for s in steps if s < step and (directory / str(s) / manifest.MANIFEST).exists()
            ]
            if older and not allow_unverified:
                target = set_aside(manager, step, UNVERIFIED_SUFFIX)
                say(
                    f"checkpoint step {step} has {verdict.why}: set it aside to {target}, "
                    f"trying the older verified step {older[0]} (to read it, rename it back and "
                    f"give --allow-unverified)"
                )
                continue
            if not allow_unverified:
                raise UsageError(
                    f"--resume: checkpoint step {step} in {directory} has {verdict.why}; resume "
                    f"from it unverified with --allow-unverified"
                )
            say(f"checkpoint step {step} has {verdict.why}: reading it unverified")
        try:
            saved_tree = _saved_tree(manager, step)
            saved_config = manager.restore(
                step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
            )
            saved_config = saved_config[CONFIG]
        except Exception as e:  # orbax and tensorstore raise many types for unreadable files
            problems.append(_set_aside(manager, step, error_line(e), say))
            continue
        if check_config is not None:
            check_config(saved_config, f"the checkpoint at step {step} in {directory}")
        target, absent, extra = _with_saved_optional(abstract_state, saved_tree, optional)
        shapes.check_shapes(
            shapes.tree_shapes(saved_tree), target, step, directory, saved_config, model_config
        )
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE: ocp.args.StandardRestore(target),
                        DATA: ocp.args.JsonRestore(),
                    }
                ),
            )
        except Exception as e:
            problems.append(_set_aside(manager, step, error_line(e), say))
            continue
        state, data = dict(restored[STATE]), restored[DATA]
        wrong = state_check.implausible(state, data.get(state_check.NORMS))
        if wrong is not None:
            problems.append(_set_aside(manager, step, f"restored, {wrong}", say))
            continue
        if problems:
            say(f"resuming from step {step}, the newest readable checkpoint in {directory}")
        for path in absent:
            say(optional[path][0].format(step=step))
        for path in extra:
            say(optional[path][1].format(step=step))
            state = _without(state, path)
        return Restored(step, state, data, saved_config)
    raise UsageError(
        f"--resume: no checkpoint in {directory} could be read ({'; '.join(problems)}); "
        f"the damaged steps were moved aside to <step>{DAMAGED_SUFFIX}"
    )


def agreed_verdict(step_dir: Any) -> manifest.Verdict:
    """The manifest's verdict on a step folder, the same on every process: process 0 reads the
    files and tells the others, so all set the step aside or all read it (and the folder is read
    once, not once per process)."""
    verdict = manifest.verify(step_dir) if jax.process_index() == 0 else manifest.Verdict("ok")
    if jax.process_count() == 1:
        return verdict
    status = ocp.multihost.broadcast_one_to_all(np.int32(manifest.STATUSES.index(verdict.status)))
    if jax.process_index() == 0:
        return verdict
    return manifest.Verdict(manifest.STATUSES[int(status)], "(see process 0)")


def _saved_tree(manager: ocp.CheckpointManager, step: int) -> Any:
    """The state arrays stored at `step`: their metadata (shape, dtype), in the state's tree."""
    metadata = manager.item_metadata(step)[STATE]
    if metadata is None:
        raise FileNotFoundError(f"step {step} has no readable `{STATE}` metadata")
    return metadata.tree


def _with_saved_optional(
    target: dict[str, Any], saved: Any, optional: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str], list[str]]:
    """(the restore target, the optional paths it leaves out, those it adds): `target` without
    the optional entries the checkpoint lacks, and with those only the checkpoint holds, as
    saved (shape, dtype) and replicated, to be read and dropped."""
    absent, extra = [], []
    for path in optional:
        here, there = _entry(target, path), _entry(saved, path)
        if here is not None and there is None:
            absent.append(path)
            target = _without(target, path)
        elif here is None and there is not None:
            extra.append(path)
            # replicated on the run's mesh, as the loss scale's entries are
            mesh = jax.tree.leaves(target)[0].sharding.mesh
            as_saved = functools.partial(_abstract, sharding=NamedSharding(mesh, PartitionSpec()))
            target = _with(target, path, jax.tree.map(as_saved, there))
    return target, absent, extra


def _abstract(saved: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(saved.shape, saved.dtype, sharding=sharding)


def _entry(tree: Any, path: str) -> Any:
    """The subtree of nested dicts `tree` at "a/b/c", or None."""
    for key in path.split("/"):
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _with(tree: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of nested dicts `tree` with `value` at "a/b/c" (the dicts on the way copied)."""
    key, _, rest = path.partition("/")
    return {**tree, key: _with(dict(tree.get(key, {})), rest, value) if rest else value}


def _without(tree: dict[str, Any], path: str) -> dict[str, Any]:
    """A copy of nested dicts `tree` without the entry at "a/b/c"."""
    key, _, rest = path.partition("/")
    if not rest:
        return {k: v for k, v in tree.items() if k != key}
    return {**tree, key: _without(dict(tree[key]), rest)}


def _set_aside(
    manager: ocp.CheckpointManager, step: int, what: str, say: Callable[[str], None]
) -> str:
    """Move a damaged step to <step>.damaged (kept for inspection, never reused); one line on
    what was wrong with it (`what`)."""
    target = set_aside(manager, step, DAMAGED_SUFFIX)
    say(f"checkpoint step {step} is damaged: {what}; moved it to {target}, trying an older one")
    return f"step {step}: {what}"
