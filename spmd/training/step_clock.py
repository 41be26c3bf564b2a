"""The time of every optimizer step, and what a step's time includes besides the step.

The loop dispatches step i + 1 before it fetches step i's metrics, so step i's metrics reach
the host about when the device finishes step i: the wall time between two consecutive
fetches is one step's time, with nothing averaged over a log interval. A step whose interval
held more than the step is marked with what it held (`step_includes` in its train record):

    compile   the first step of the process, or the first after a rollback's recompile: the
              executable's first run and whatever the loop compiles on first use
    eval      an evaluation ran after the step before (the device's queue was empty, and the
              eval's time is in this step's)
    sample    --sample-every's samples were drawn after the step before
    save      a checkpoint was queued after the step before (its blocking part is in here)
    profile   a --profile trace started or stopped in it (the trace's own start / stop time
              is taken out, the device's tracing overhead is not)

The closing line and the summary record report the median and the 90th percentile of the
steps marked with none of these.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

INCLUDES = ("compile", "eval", "sample", "save", "profile")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of `values` (at least one): the smallest
    value that at least q% of them are at or below."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]


class StepClock:
    """Per-step wall times (seconds) by step, and the marks of the steps that include more."""

    def __init__(self, first_step: int) -> None:
        self.times: dict[int, float] = {}
        self.includes: dict[int, list[str]] = {}
        self.coming: set[str] = {"compile"}  # what the next timed step includes
        self.last_step, self.start = first_step - 1, time.perf_counter()

    def pause(self, seconds: float) -> None:
        """Leave `seconds` of host work out of the step being timed."""
        self.start += seconds

    def restart(self) -> None:
        """Time the next step from now."""
        self.start = time.perf_counter()

    def rewind(self, step: int) -> None:
        """Go on timing from `step`, where a rollback restarts with a recompiled step."""
        self.last_step, self.start = step, time.perf_counter()
        self.coming.add("compile")

    def include(self, what: str) -> None:
        """Mark the next timed step as including `what` (one of INCLUDES)."""
        self.coming.add(what)

    def tick(self, step: int) -> float:
        """Step `step`'s metrics arrived now: its time in seconds (the time since the previous
        step's arrived, shared evenly if steps in between were never timed)."""
        now = time.perf_counter()
        seconds = (now - self.start) / max(step - self.last_step, 1)
        self.last_step, self.start = step, now
        self.times[step] = seconds
        self.includes[step] = [w for w in INCLUDES if w in self.coming]
        self.coming.clear()
        return seconds

    def plain(self) -> list[float]:
        """Times of the steps that include nothing else (all of them when every one does)."""
        plain = [t for s, t in self.times.items() if not self.includes[s]]
        return plain or list(self.times.values())

    def summary(self) -> dict[str, Any]:
        """median_step_time_s and p90_step_time_s of the plain steps, plain_steps (how many),
        timed_steps (all steps timed in this process) and marked_steps (how many steps include
        each thing; a step may include several)."""
        plain = self.plain()
        marked = {w: sum(w in m for m in self.includes.values()) for w in INCLUDES}
        return {
            "median_step_time_s": statistics.median(plain),
            "p90_step_time_s": percentile(plain, 90),
            "plain_steps": len(plain),
            "timed_steps": len(self.times),
            "marked_steps": {w: n for w, n in marked.items() if n},
        }
