"""How a Program's steps are built, beside the model, loss, optimizer and layout: one frozen
dataclass that spmd.engine.step.build_program, both executors (spmd.engine.auto and
spmd.engine.explicit) and spmd.engine.diloco take, so the list is written once."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from spmd.engine import precision
from spmd.sections import PAIRS, ParallelConfig

if TYPE_CHECKING:
    from spmd.parallel.pipeline import Pipeline

TOKENS = ("inputs", "targets")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a run's steps do beside the model and the layout.

    - seed: the model's init seed (`make_model(seed)`).
    - accum: micro-batches per optimizer step (the batch's dimension 0 split accum ways), one
      gradient reduction per step. The executors get the micro-batches the step itself loops
      over (1 under a pipeline, whose schedule accumulates them).
    - policy: master-weight dtype, gradient accumulation / reduction dtype, fp16 loss scaling
      (spmd.engine.precision).
    - executor: "auto" (XLA inserts the collectives) or "explicit" (shard_map, by hand).
    - pipeline: the schedule of a pp > 1 mesh (spmd.parallel.pipeline.Pipeline); None at pp=1.
    - bucket_mb: explicit executor: reduce the gradients in buckets of about this many MiB, one
      collective each (0: one per param); auto leaves it to XLA's combine thresholds.
    - prefetch: explicit executor with ZeRO-3: gather each layer's params while the layer before
      it computes (spmd.parallel.layer_scan).
    - batch_fields: the keys of the batches the step takes (spmd.io.data.TokenWindows.fields);
      a pair batch's (PAIRS) rows go to the micro-batches two by two (`row_group`).
    - offload_state: "none", "optimizer" (optimizer state and master weights in host memory
      between steps) or "params" (the params too); spmd.engine.offload.
    - elementwise: the optimizer's update of each element reads only that element (AdamW,
      Lion; spmd.engine.optim.Optimizer.elementwise); False (Muon): the explicit executor
      updates whole params, gathered, instead of each device's slice.
    - eval_params: (master weights, optimizer state) -> the params to evaluate and export
      (schedule-free AdamW's average; Program.checkpoint_view's "eval_params"); None: the params.
    - exclude_axes: mesh axes the auto executor's activation rules leave to an enclosing vmap
      (spmd.engine.diloco sets them; `Program.train_fn` is then the step to vmap).
    """

    seed: int = 0
    accum: int = 1
    policy: precision.Policy = precision.POLICIES["fp32"]
    executor: str = "auto"
    pipeline: Pipeline | None = None
    bucket_mb: float = 0.0
    prefetch: bool = ParallelConfig.prefetch
    batch_fields: tuple[str, ...] = TOKENS
    offload_state: str = "none"
    exclude_axes: tuple[str, ...] = ()
    elementwise: bool = True
    # the optimizer's params to evaluate (spmd.engine.optim.Optimizer.eval_params), or None
    eval_params: Any = None

    def pipelined(self, mesh: Any) -> bool:
        """Whether a pipeline schedule runs on `mesh`: one is given and pp > 1."""
        return self.pipeline is not None and mesh.shape["pipeline"] > 1

    @property
    def row_group(self) -> int:
        """Consecutive rows of a batch that accumulation keeps in one micro-batch: 2 for a
        batch of preference pairs (its PAIRS field: a pair's chosen and rejected rows), else
        1 (spmd.engine.accumulate.micro_batches)."""
        return 2 if PAIRS in self.batch_fields else 1

    @property
    def bucket_bytes(self) -> int:
        """bucket_mb in bytes (0: one collective per param)."""
        return int(self.bucket_mb * 2**20)


DEFAULTS = StepOptions()  # every field at its default
