"""A run's evals: the mean loss over --eval-batches batches of the held-out split and of each
named eval set (--eval-data, a mixture's sources' held-out windows), and the check of
--eval-batches against the sets' windows.

The training loop (spmd.training.loop) makes one evaluator per run and calls it before the
first step (--eval-at-start), every --eval-every steps and at the end; a stop all processes
agreed on cuts an eval short.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmd.errors import UsageError
from spmd.io import data
from spmd.log import say

if TYPE_CHECKING:
    from spmd.training.loop import Run


def make_evaluator(run: Run) -> Callable[[Any, int], float | None]:
    """evaluate(params, step): the mean loss over --eval-batches held-out batches, logged and
    printed, and that of each named eval set (their record's `losses`; `loss` is the held-out
    split's, else the first set's). The eval step is compiled on first use: runs without an
    eval split skip it. `run` is the loop's spmd.training.loop.Run (which imports this module:
    the loop makes the evaluator)."""

    program = run.program
    compiled_eval: list[Any] = []

    def evaluate(params: Any, step: int) -> float | None:
        if not compiled_eval:
            abstract_batch = program.abstract_batch(run.cfg.run.batch, run.cfg.run.seq_len)
            compiled_eval.append(
                program.eval_step.lower(program.abstract_params, abstract_batch).compile()
            )
        sharding = program.layout.batch_sharding()
        sets = {"held-out": run.windows} if run.windows.n_eval else {}
        losses, recent = {}, list[Any]()  # recent: the losses of the last two batches dispatched
        run.stop.begin_eval()
        for name, windows in {**sets, **run.eval_sets}.items():
            # one batch at a time, the sum kept on the device (memory does not grow with
            # --eval-batches), one batch queued ahead of the device: a stop waits for two
            # batches, not thousands, and no process of a job gets more than two ahead
            total = None
            for i in range(run.cfg.data.eval_batches):
                if len(recent) == 2:
                    recent.pop(0).block_until_ready()
                cut = run.stop.cut_eval()
                if cut:
                    say(f"eval at step {step} cut short by {cut}")
                    return None
                ids = data.eval_window_ids(i, run.cfg.run.batch, windows)
                loss = compiled_eval[0](params, data.global_batch(windows, ids, sharding))
                total = loss if total is None else total + loss
                recent.append(loss)
            losses[name] = float(np.asarray(jax.device_get(total))) / run.cfg.data.eval_batches
        loss = next(iter(losses.values()))
        if run.eval_sets:
            run.log.write("eval", step=step, loss=loss, losses=losses)
            say(f"eval at step {step}: " + " | ".join(f"{n} {v:.4f}" for n, v in losses.items()))
        else:
            run.log.write("eval", step=step, loss=loss)
            say(f"eval at step {step}: loss {loss:.4f}")
        return loss

    return evaluate


def check_eval_batches(eval_batches: int, sets: dict[str, Any]) -> None:
    """UsageError when --eval-batches is more than the windows of an eval set (each batch
    holds one window at least; past that every window is counted again and the eval only
    takes longer, without bound). The default count stays valid on a small corpus, whose
    batches wrap around its few windows."""
    from spmd.sections import DataConfig

    for name, windows in sets.items():
        limit = max(windows.n_eval, DataConfig.eval_batches)
        if windows.n_eval and eval_batches > limit:
            raise UsageError(
                f"--eval-batches {eval_batches} is more than the {windows.n_eval} windows of the "
                f"{name} eval set; give at most {limit}"
            )
