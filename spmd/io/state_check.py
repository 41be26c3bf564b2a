"""Is a restored train state what was saved? Finite values and the norms saved with the step.

A manifest (spmd.io.manifest) proves a step's files are the bytes written; a step without one
(an older spmd's, or a kill between orbax's commit and the manifest) proves nothing, and flipped
bytes in its arrays restore without complaint: weights of 1e28 whose loss sticks and whose
gradient norm is 0, so no divergence check fires and the next save certifies the garbage. So a
save also records, in the step's data state, the L2 norm of each entry of the state
(`{"params": 41.3, "opt_state": 0.52, "loss_scale": 1.0}`, fp32 sums of squares), and every
restore compares: a norm that is not finite, or that differs from the saved one by more than
NORM_RTOL (the same bits summed in another order on another mesh differ by ~1e-6), marks the
step damaged. A step saved before norms were recorded is held to finite values and a
plausible scale: its params' root-mean-square at most MAX_PARAMS_RMS (trained weights sit
near 0.01-1; the weights flipped bytes make are many orders above).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

NORMS = "state_norms"  # the data state's key of the saved norms
NORM_RTOL = 1e-3
MAX_PARAMS_RMS = 1e3


@functools.cache
def _norms_program(names: tuple[str, ...]) -> Any:
    def norms(state: dict[str, Any]) -> dict[str, jax.Array]:
        out = {}
        for name in names:
            leaves = [
                x for x in jax.tree_util.tree_leaves(state[name])
                if jnp.issubdtype(x.dtype, jnp.floating)
            ]  # fmt: skip
            squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves]
            out[name] = jnp.sqrt(sum(squares, jnp.float32(0)))
        return out

    return jax.jit(norms)


def state_norms(state: dict[str, Any]) -> dict[str, float]:
    """{entry: L2 norm of its floating-point values} of a train state (global arrays, so the
    same on every process)."""
    names = tuple(sorted(state))
    return {k: float(v) for k, v in jax.device_get(_norms_program(names)(state)).items()}


def implausible(state: dict[str, Any], saved: dict[str, float] | None) -> str | None:
    """Why a restored `state` cannot be what was saved (one phrase), or None: a norm not
    finite, unlike the `saved` norms, or (no norms saved) params of an implausible scale."""
    found = state_norms(state)
    for name, norm in found.items():
        if not math.isfinite(norm):
            return f"its {name} hold values that are not finite (or above 1e19)"
    if saved:
        for name, norm in found.items():
            want = saved.get(name)
            if want is not None and abs(norm - want) > NORM_RTOL * max(abs(want), 1e-12):
                return f"its {name} have norm {norm:.6g} where {want:.6g} was saved"
        return None
    count = sum(x.size for x in jax.tree_util.tree_leaves(state.get("params", {})))
    rms = found.get("params", 0.0) / math.sqrt(max(count, 1))
    if rms > MAX_PARAMS_RMS:
        return f"its params have root-mean-square {rms:.3g}, above a trained model's scale"
    return None
