"""The registry of training objectives: one line per objective, and the lookup by the name
--objective gives (spmd.engine.objective says what an objective is; docs/extending.md how to
add one).

    objectives.get("next_token")   the objective called "next_token" (UsageError naming the
                                   valid ones)
"""

from __future__ import annotations

from spmd.engine import preference
from spmd.engine.objective import NEXT_TOKEN, Objective
from spmd.errors import UsageError

# The registry: one line per objective.
OBJECTIVES: dict[str, Objective] = {
    o.name: o for o in (NEXT_TOKEN, preference.DPO, preference.ORPO)
}


def get(name: str) -> Objective:
    """The objective called `name`; UsageError naming the valid ones otherwise."""
    if name not in OBJECTIVES:
        raise UsageError(f"--objective {name!r} is not one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]
