"""Delayed fp8 scaling's state: an amax history per block matmul, kept in the train state.

The state is {"amax_history": fp32 [layers, SITES, 3, history]}: for each stacked layer and
each of its fp8 matmuls (in call order, spmd.parallel.fp8_context), the absolute maxima of
its input, weight and output gradient over the last `history` steps, newest first. It rides
in the train state's loss-scale dict (spmd.engine.precision), so it is replicated on every
device, saved in every checkpoint and restored with it: a resumed run scales exactly as the
uninterrupted one would.

A step quantizes with scale = max(history) / max(fp8) (448 for the e4m3 input and weight,
57344 for the e5m2 gradient), as Transformer Engine's "max" amax algorithm does; a matmul
whose history is still empty (the first step) scales by its current amax instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmd.parallel import traced_layout
from spmd.parallel.fp8_context import FORMAT_MAX, GRAD_FORMAT, SITES, Fp8Settings

# the largest finite value of the input's (e4m3), the weight's (e4m3) and the gradient's format
FP8_MAX = (FORMAT_MAX["e4m3"], FORMAT_MAX["e4m3"], FORMAT_MAX[GRAD_FORMAT["delayed"]])
SEEN = "fp8_seen"  # the loss-scale dict's key for the amaxes a step saw, until it is folded

# The history is the one part of a checkpoint that a change of precision on resume may add or
# drop (spmd.io.checkpoint_restore's `optional`): {its path in the checkpoint: (the line said
# when the checkpoint lacks it, the line said when only the checkpoint holds it)}.
CHECKPOINT_OPTIONAL = {
    "loss_scale/fp8": (
        "checkpoint step {step} has no fp8 amax history (saved without --fp8-recipe delayed): "
        "the params, optimizer state and step come from it, the history starts empty as a new "
        "delayed run's does",
        "checkpoint step {step} holds an fp8 amax history (saved with --fp8-recipe delayed), "
        "which this run does not scale by: dropped it",
    )
}


def init(settings: Fp8Settings) -> dict[str, jax.Array]:
    """The state at step 0: an empty (all-zero) history."""
    shape = (max(settings.layers, 1), SITES, 3, settings.history)
    return {"amax_history": jnp.zeros(shape, jnp.float32)}


def scales(state: dict[str, jax.Array]) -> jax.Array:
    """[layers, SITES, 3] scales of this step from the history (0 where it is empty: the
    quantized matmul then scales by the current amax)."""
    amax = state["amax_history"].max(axis=-1)
    return amax / jnp.asarray(FP8_MAX, jnp.float32)


def probe(state: dict[str, jax.Array]) -> jax.Array:
    """Zeros [layers, SITES, 3] to differentiate: their cotangent is the amaxes the step saw.
    Inside the explicit executor they vary over every mesh axis, so that each device's amaxes
    come back unsummed (a cotangent of a replicated value would be psummed)."""
    zeros = jnp.zeros(state["amax_history"].shape[:-1], jnp.float32)
    axes = _explicit_axes()
    return lax.pcast(zeros, axes, to="varying") if axes else zeros


def _explicit_axes() -> tuple[str, ...]:
    """The mesh axes over 1 of the explicit step being traced (none outside it)."""
    mesh = traced_layout.explicit_mesh()
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1) if mesh is not None else ()


def fold(loss_scale: dict[str, Any]) -> dict[str, Any]:
    """The loss-scale dict with the amaxes of this step (its SEEN entry, when the step put one
    there) pushed into the history, the oldest dropped: the max over every device first
    inside the explicit executor."""
    if SEEN not in loss_scale:
        return loss_scale
    state = dict(loss_scale)
    seen = state.pop(SEEN)
    axes = _explicit_axes()
    if axes:
        seen = lax.pmax(seen, axes)
    history = state["fp8"]["amax_history"]
    history = jnp.concatenate([seen[..., None], history[..., :-1]], axis=-1)
    state["fp8"] = {"amax_history": history}
    return state
