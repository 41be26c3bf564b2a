"""spmd as an lm-evaluation-harness model: `SpmdLM` implements lm_eval.api.model.LM on a
spmd.run.harness.Harness, and `evaluate` runs tasks on it (lm-eval's own task registry, a
folder of task YAMLs with `--include-path`). The only module that imports lm_eval, and only
spmd.eval and a training run with --eval-harness-every import it; pip install -e ".[eval]".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from spmd.errors import UsageError
from spmd.io.tokens import _load_tokenizer
from spmd.log import say
from spmd.run import harness_text
from spmd.run.harness import Harness
from spmd.sections import DataConfig

if TYPE_CHECKING:
    from spmd.engine.step import Program


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
        beside = f" nor in the include path {include_path}" if include_path else ""
        raise UsageError(
            f"--tasks {unknown[0]} is not a task, group or tag of lm-eval's{beside}; give one "
            f"that `lm-eval ls tasks` lists, or a folder of task YAMLs with --include-path"
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
    """{"task/metric": value} of results' scores ("acc,none" is "acc"; stderrs and document
    counts left out)."""
    out: dict[str, float] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            counted = isinstance(value, int | float) and not isinstance(value, bool)
            if "_stderr" in metric or metric == "sample_len" or not counted:
                continue
            out[f"{task}/{metric}" if kind in ("none", "") else f"{task}/{metric},{kind}"] = value
    return out


def table(results: dict[str, Any]) -> str:
    """lm-eval's printed table of results."""
    from lm_eval.utils import make_table

    return make_table(results)


def training_tasks(data: DataConfig) -> tuple[list[str], TaskManager]:
    """The task names of --eval-harness-tasks and their manager; UsageError for an unknown
    one (a training run asks before its mesh)."""
    names = [name.strip() for name in data.eval_harness_tasks.split(",") if name.strip()]
    return names, task_manager(names, data.eval_harness_include_path)


def training_evaluator(
    data: DataConfig,
    tasks: tuple[list[str], TaskManager],
    program: Program,
    rows: tuple,
    log: Any,
) -> Callable[[Any, int], dict[str, float]]:
    """evaluate(params, step) of a training run's --eval-harness-every: the `tasks` on the
    current params with the run's program and shardings (no copy of the weights), `rows`
    (--seq-len, --batch): rows of at most --seq-len tokens in batches of --batch; the scores
    logged as an `eval_harness` record (`scores`: {"task/metric": value}) and printed."""
    (names, manager), (seq_len, batch) = tasks, rows
    path = data.tokenizer
    if path and Path(path).is_dir():
        path = str(Path(path) / "tokenizer.json")
    text = harness_text.text_of(_load_tokenizer(path) if path else None, path)

    def evaluate_at(params: Any, step: int) -> dict[str, float]:
        scorer = Harness(program, params, text, seq_len, batch)
        found = scores(evaluate(scorer, names, manager, data.eval_harness_limit))
        log.write("eval_harness", step=step, scores=found)
        say(f"lm-eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in found.items()))
        return found

    return evaluate_at
