"""The layout a step is being traced under: what turns the model's hooks (spmd.parallel.hooks)
into collectives or sharding constraints.

The engine opens one of these contexts while it traces a step; the hooks read the innermost:

    explicit_layout(mesh, zero_stage, ...)   inside the explicit executor's shard_map: the hooks
                                             become hand-written collectives
    activation_layout(mesh, zero_stage, ...) under the auto executor's jit: `constrain` pins
                                             activations to the layout's shardings
    no_activation_layout()                   inside a manual shard_map: `constrain` does nothing
    manual_context(mesh)                     a pipeline stage manual over the context axis: the
                                             context hooks act on this device's chunks
    params_whole()                           a layer of ZeRO-3's prefetching scan: its params
                                             arrive gathered
    training(step)                           a train step (not eval): dropout applies, its
                                             masks drawn anew for each optimizer step
    pipeline_chunk(first_layer, inputs)      a pipeline stage's chunk of the layer stack: the
                                             global index of its first layer and the token
                                             ids of its micro-batch
    context_attention(mode)                  how attention crosses a length split over
                                             `context`: "ring" (the default) or "ulysses"

Below the hooks, so that every hook module can use them: `constrain` (an activation pinned
to the auto layout) and `note` / `notes` (the choices recorded while tracing).

Outside all of them the hooks are no-ops and a model runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding

from spmd.parallel import rules


@dataclasses.dataclass(frozen=True)
class ExplicitLayout:
    """What the explicit executor's hooks need: the mesh, the params' rules (how they are
    stored) and the activations' rules (how the compute uses them)."""

    mesh: jax.sharding.Mesh
    param_rules: rules.Rules
    compute_rules: rules.Rules
    prefetch: bool  # ZeRO-3: gather layer i+1 while layer i computes


_EXPLICIT: list[ExplicitLayout] = []
_ACTIVATIONS: list[tuple[jax.sharding.Mesh | jax.sharding.AbstractMesh, rules.Rules, bool]] = []
_MANUAL_CONTEXT: list[tuple[str | None, int]] = []  # (axis, ways) made manual by the engine
_PARAMS_WHOLE: list[bool] = []  # inside a prefetched layer: its params arrive gathered
_TRAINING: list[jax.Array | None] = []  # inside a train step's loss: its step number
_CHUNK: list[tuple[jax.Array, jax.Array]] = []  # a pipeline chunk: (first layer, token ids)
_CP_MODE: list[str] = []  # how attention crosses a split length: "ring" or "ulysses"


@contextlib.contextmanager
def training(step: jax.Array | None = None) -> Iterator[None]:
    """While tracing a train step's loss (its gradients are taken): dropout applies. `step`:
    the optimizer steps taken so far (a traced int scalar, the same on every device), which
    dropout's masks hash in; None draws the same masks at every step."""
    _TRAINING.append(step)
    try:
        yield
    finally:
        _TRAINING.pop()


def in_training() -> bool:
    """Whether a train step is being traced (`training`)."""
    return bool(_TRAINING)


def training_step() -> jax.Array | None:
    """The step number `training` was given (None outside a train step or without one)."""
    return _TRAINING[-1] if _TRAINING else None


@contextlib.contextmanager
def pipeline_chunk(first_layer: jax.Array, inputs: jax.Array) -> Iterator[None]:
    """While tracing a pipeline stage's chunk of the stacked layers on one micro-batch:
    `first_layer` (a traced int32 scalar) is the global index of the chunk's first layer (the
    chunk counts from 0), `inputs` the micro-batch's token ids [batch, length]."""
    _CHUNK.append((first_layer, inputs))
    try:
        yield
    finally:
        _CHUNK.pop()


def chunk_first_layer() -> jax.Array | int:
    """The global index of the first layer of the stack being traced (`pipeline_chunk`; 0
    outside a pipeline chunk)."""
    return _CHUNK[-1][0] if _CHUNK else 0


def chunk_inputs() -> jax.Array | None:
    """The token ids of the micro-batch a pipeline chunk runs on (`pipeline_chunk`; None
    outside one, where a model's loss sees the whole batch)."""
    return _CHUNK[-1][1] if _CHUNK else None


@contextlib.contextmanager
def explicit_layout(
    mesh: jax.sharding.Mesh,
    zero_stage: int,
    sequence_parallel: bool = False,
    *,
    prefetch: bool,
) -> Iterator[None]:
    """While tracing inside a shard_map over `mesh`, make the hooks real collectives.
    `prefetch`: scan_layers gathers each layer's params one layer ahead (ZeRO-3)."""
    param_rules = rules.rules_for(zero_stage, "params")
    compute = rules.rules_for(zero_stage, "activations", sequence_parallel)
    _EXPLICIT.append(ExplicitLayout(mesh, param_rules, compute, prefetch))
    try:
        yield
    finally:
        _EXPLICIT.pop()


def explicit() -> ExplicitLayout | None:
    """The explicit layout being traced (None outside `explicit_layout`)."""
    return _EXPLICIT[-1] if _EXPLICIT else None


def explicit_mesh() -> jax.sharding.Mesh | None:
    """The mesh of the explicit step being traced (None outside `explicit_layout`)."""
    return _EXPLICIT[-1].mesh if _EXPLICIT else None


def tracing_explicit() -> ExplicitLayout:
    """The explicit layout being traced, for code that runs only inside `explicit_layout`
    (a collective of the explicit executor): RuntimeError outside one."""
    if not _EXPLICIT:
        raise RuntimeError("an explicit collective traced outside spmd's explicit_layout")
    return _EXPLICIT[-1]


def mesh_axes(layout: ExplicitLayout, table: rules.Rules, name: str | None) -> tuple[str, ...]:
    """The mesh axes over 1 that `table` maps logical dimension `name` to."""
    named = table.get(name, ()) if name is not None else ()
    return tuple(a for a in named if layout.mesh.shape[a] > 1)


def split_axes(name: str) -> tuple[str, ...]:
    """Mesh axes that split activations' logical dimension `name` in the explicit layout being
    traced (() when none is active)."""
    layout = explicit()
    return mesh_axes(layout, layout.compute_rules, name) if layout else ()


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which `x` (an array or abstract value) varies inside shard_map; empty
    outside. jax 0.10 keeps them in `manual_axis_type.varying`, earlier versions in `vma`."""
    abstract = isinstance(x, jax.ShapeDtypeStruct | jax.core.AbstractValue)
    aval = x if abstract else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


@contextlib.contextmanager
def activation_layout(
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    zero_stage: int,
    exclude: tuple[str, ...] = (),
    sequence_parallel: bool | None = None,
) -> Iterator[None]:
    """Within this context, `hooks.constrain` pins activations to the layout's shardings. Mesh
    axes in `exclude` are left out of every rule (e.g. axes a `vmap(spmd_axis_name=...)` owns).
    `sequence_parallel` None keeps the enclosing layout's setting (off when there is none)."""
    if sequence_parallel is None:
        sequence_parallel = bool(_ACTIVATIONS) and _ACTIVATIONS[-1][2]
    table = rules.rules_for(zero_stage, "activations", sequence_parallel)
    _ACTIVATIONS.append(
        (
            mesh,
            {k: tuple(a for a in v if a not in exclude) for k, v in table.items()},
            sequence_parallel,
        )
    )
    try:
        yield
    finally:
        _ACTIVATIONS.pop()


@contextlib.contextmanager
def no_activation_layout() -> Iterator[None]:
    """Within this context `hooks.constrain` does nothing (e.g. inside a manual shard_map)."""
    saved = list(_ACTIVATIONS)
    _ACTIVATIONS.clear()
    try:
        yield
    finally:
        _ACTIVATIONS.extend(saved)


def activations() -> tuple[jax.sharding.Mesh | jax.sharding.AbstractMesh, rules.Rules, bool] | None:
    """(mesh, activation rules, sequence parallel) of the auto layout being traced, or None."""
    return _ACTIVATIONS[-1] if _ACTIVATIONS else None


@contextlib.contextmanager
def manual_context(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> Iterator[None]:
    """Inside a shard_map manual over the axis that splits `length` but not over every axis
    (the auto executor's pipeline stages): the context hooks act on this device's chunks as
    under the explicit executor (the ring's ppermutes written directly, not nested)."""
    axes = tuple(a for a in rules.BASE_RULES["length"] if mesh.shape[a] > 1)
    _MANUAL_CONTEXT.append((axes[0], mesh.shape[axes[0]]) if axes else (None, 1))
    try:
        yield
    finally:
        _MANUAL_CONTEXT.pop()


def manual_context_axis() -> tuple[str | None, int] | None:
    """(axis, ways) of the context axis a `manual_context` made manual, or None."""
    return _MANUAL_CONTEXT[-1] if _MANUAL_CONTEXT else None


@contextlib.contextmanager
def params_whole() -> Iterator[None]:
    """Inside a layer of ZeRO-3's prefetching scan (spmd.parallel.layer_scan): its params arrive
    gathered, so `hooks.gather` returns them as they are."""
    _PARAMS_WHOLE.append(True)
    try:
        yield
    finally:
        _PARAMS_WHOLE.pop()


def params_arrive_whole() -> bool:
    """Whether the layer being traced runs inside `params_whole`."""
    return bool(_PARAMS_WHOLE)


@contextlib.contextmanager
def context_attention(mode: str) -> Iterator[None]:
    """While tracing a step of a Layout whose cp_mode is `mode`: the context hooks' attention
    runs as a ring ("ring") or as Ulysses' all-to-alls ("ulysses")."""
    if mode not in ("ring", "ulysses"):
        raise ValueError(f"context attention {mode!r}: ring or ulysses")
    _CP_MODE.append(mode)
    try:
        yield
    finally:
        _CP_MODE.pop()


def context_attention_mode() -> str:
    """The innermost `context_attention`'s mode; "ring" outside one."""
    return _CP_MODE[-1] if _CP_MODE else "ring"


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Hint the partitioner that activation `x` (logical `names`) is laid out by the auto
    layout being traced (`activation_layout`); `x` itself outside one (hooks.constrain)."""
    if (auto := activations()) is None:
        return x
    mesh, table, _ = auto
    spec = rules.partition_spec(names, x.shape, table, mesh, f"activation {names}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


_NOTES: dict[str, str] = {}


def note(what: str, choice: str) -> None:
    """Record a choice the model made while being traced (e.g. which attention kernel ran), so
    the run can report it; the latest trace wins (hooks.note)."""
    _NOTES[what] = choice


def notes() -> dict[str, str]:
    """The choices `note` recorded so far, e.g. {"attention": "cudnn"}."""
    return dict(_NOTES)
