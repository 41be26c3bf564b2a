"""A planned pipeline's schedule in closed form: the ticks, stashed inputs and bubble share of
spmd.parallel.schedules' tick tables for a planned step (spmd.estimate.cost.Setup), which
tests/test_plan.py checks against the tables themselves. Pure arithmetic."""

from __future__ import annotations

from typing import Any

from spmd.parallel import schedules


def pipeline_ticks(s: Any) -> int:
    """Ticks of the schedule's table (spmd.parallel.schedules) for the step's M micro-batches
    on p stages: gpipe 2(M + p - 1) - 1; 1f1b and interleaved v M + (v + 1) p - 2. 0 if pp = 1."""
    p, m, v = s.mesh["pipeline"], s.micro_steps, s.virtual
    if p == 1:
        return 0
    return 2 * (m + p - 1) - 1 if s.schedule == "gpipe" else v * m + (v + 1) * p - 2


def stashed_inputs(s: Any) -> int:
    """Chunk inputs plus output gradients a stage holds at most (the table's stash and inbox
    slots): gpipe M + M; 1f1b min(M, 2p - 1) + 1; interleaved min(v M, (v + 1) p - 1) + 1."""
    p, m, v = s.mesh["pipeline"], s.micro_steps, s.virtual
    if p == 1:
        return 0
    if s.schedule == "gpipe":
        return 2 * m
    return min(v * m, (v + 1) * p - 1) + 1


def bubble_share(s: Any) -> float:
    """Textbook idle share of a pipelined step, (p - 1) / (M + p - 1) / v (0 without one)."""
    p = s.mesh["pipeline"]
    return schedules.bubble_fraction(p, s.micro_steps, s.virtual) if p > 1 else 0.0
