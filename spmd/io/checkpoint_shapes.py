"""A checkpoint's array shapes against a run's: which param or optimizer entry differs first,
named for people, with the model flags that would make them agree (spmd.io.checkpoint and
spmd.io.params_io read them before restoring anything)."""

from __future__ import annotations

from typing import Any

import jax

from spmd.errors import UsageError


def tree_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_name(path): tuple(leaf.shape) for path, leaf in flat}


def path_name(path: tuple) -> str:
    parts = []
    for key in path:
        for attribute in ("key", "idx", "name"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
    return "/".join(parts)


def check_shapes(
    saved: dict[str, tuple[int, ...]],
    abstract_state: dict[str, Any],
    step: int,
    directory: Any,
    saved_config: dict[str, Any],
    model_config: dict[str, Any],
) -> None:
    """UsageError naming the first param (params before optimizer state) whose shape differs."""
    current = tree_shapes(abstract_state)
    where = f"the checkpoint at step {step} in {directory}"
    hint = config_hint(saved_config.get("model", {}), model_config)
    difference = shape_difference(saved, current, first=lambda n: n.startswith("params"))
    if difference is None:
        return
    name, kind = difference
    if kind == "missing":
        raise UsageError(f"{where} has no {name}, which this run's train state holds{hint}")
    if kind == "extra":
        raise UsageError(f"{where} holds {name}, which this run's train state lacks{hint}")
    raise UsageError(
        f"{where} holds {name} with shape {saved[name]}, but this model's {name} has "
        f"shape {current[name]}{hint}"
    )


def shape_difference(
    saved: dict[str, tuple[int, ...]],
    current: dict[str, tuple[int, ...]],
    first: Any = lambda name: False,
) -> tuple[str, str] | None:
    """The first name (those where `first(name)` holds come first, then by name) whose shape
    differs between a checkpoint's `saved` shapes and the `current` ones, with the kind of
    difference: "missing" (not saved), "extra" (saved only) or "shape"; None if all agree."""
    for name in sorted(current.keys() | saved.keys(), key=lambda n: (not first(n), n)):
        if name not in saved:
            return name, "missing"
        if name not in current:
            return name, "extra"
        if saved[name] != current[name]:
            return name, "shape"
    return None


def config_hint(saved_model: dict[str, Any], model_config: dict[str, Any]) -> str:
    changed = [
        f"--{key.replace('_', '-')} {saved_model[key]}"
        for key in model_config
        if key in saved_model and saved_model[key] != model_config[key]
    ]
    return f"; resume with the model it was saved with ({' '.join(changed)})" if changed else ""
