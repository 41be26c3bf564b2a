"""Multi-process: every process's step time at log steps, and which processes lag behind.

A synchronous step runs at the pace of the slowest process, so a straggler shows up as the
others waiting in collectives; only the per-process host-side step times say who it is.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def find_stragglers(step_times: Sequence[float], threshold: float) -> list[int]:
    """Indices of the processes whose step time exceeds the median by more than `threshold`
    (a fraction: 0.2 means 20% slower). Fewer than two processes have no straggler."""
    if len(step_times) < 2:
        return []
    median = statistics.median(step_times)
    return [i for i, t in enumerate(step_times) if t > median * (1 + threshold)]


def describe(step_times: Sequence[float], slow: Sequence[int]) -> str:
    """One line naming each straggler, its step time and how far above the median it is."""
    median = statistics.median(step_times)
    parts = [
        f"process {i} at {step_times[i] * 1e3:.1f} ms/step ({step_times[i] / median - 1:+.1%})"
        for i in slow
    ]
    return f"straggler: {', '.join(parts)} vs the median {median * 1e3:.1f} ms/step"


def gather_step_times(step_time_s: float) -> list[float]:
    """This log step's step time of every process, indexed by process id. A collective over
    all processes (each must call it at the same step); no communication for one process."""
    import jax

    if jax.process_count() == 1:
        return [step_time_s]
    import numpy as np
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(step_time_s, np.float64))
    return [float(t) for t in np.asarray(gathered).reshape(-1)]
