"""spmd as an lm-evaluation-harness model: `SpmdLM` implements lm_eval.api.model.LM on a
spmd.run.harness.Harness, and `evaluate` runs tasks on it (lm-eval's own task registry, a
folder of task YAMLs with `--include-path`). The only module that imports lm_eval, and only
spmd.eval and a training run with --eval-harness-every import it; pip install -e ".[eval]".
"""

from __future__ import annotations

import logging
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from spmd.errors import UsageError
from spmd.run.harness import Harness


class SpmdLM(LM):
    """lm-eval's requests answered by a Harness (spmd's sharded forward and decoder)."""

    def __init__(self, harness: Harness) -> None:
        super().__init__()
        self.harness = harness

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        return self.harness.loglikelihood([tuple(r.args) for r in requests])

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        return self.harness.loglikelihood_rolling([r.args[0] for r in requests])

    def generate_until(self, requests: list[Any]) -> list[str]:
        return self.harness.generate_until([(r.args[0], r.args[1]) for r in requests])


def task_manager(names: list[str], include_path: str) -> TaskManager:
    """lm-eval's tasks with `include_path`'s; UsageError for a name it does not know."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task notices
    manager = TaskManager(include_path=include_path or None)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        where = f"lm-eval's tasks and {include_path}'s" if include_path else "lm-eval's tasks"
        raise UsageError(
            f"--tasks {unknown[0]} is not a task of {where}; give a registered task, group or "
            f"tag (lm-eval ls tasks), or a folder of task YAMLs with --include-path"
        )
    return manager


def evaluate(
    harness: Harness, names: list[str], manager: TaskManager, limit: int = 0, fewshot: int = -1
) -> dict[str, Any]:
    """lm-eval's results of the tasks `names` (`limit` documents each, 0: all; `fewshot` -1:
    each task's own): its dict with "results" and, per task, "samples"."""
    return simple_evaluate(
        model=SpmdLM(harness),
        tasks=names,
        task_manager=manager,
        limit=limit or None,
        num_fewshot=None if fewshot < 0 else fewshot,
        log_samples=True,
        bootstrap_iters=0,
    )


def scores(results: dict[str, Any]) -> dict[str, float]:
    """{"task/metric": value} of results' numbers ("acc,none" is "acc"; stderrs left out)."""
    out: dict[str, float] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if "_stderr" in metric or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            out[f"{task}/{metric}" if kind in ("none", "") else f"{task}/{metric},{kind}"] = value
    return out


def table(results: dict[str, Any]) -> str:
    """lm-eval's printed table of results."""
    from lm_eval.utils import make_table

    return make_table(results)
