"""--dpo-precompute-reference: DPO's reference log-probs of every pair, computed once before the
first step and read with the data, as TRL's `precompute_ref_log_probs`.

Without it each DPO step runs the reference's forward on its batch (LoRA's base with the
adapters off, or a full fine-tune's frozen copy: spmd.engine.preference, spmd.dpo_reference).
With it, before training, every row of the pair data (the training pairs and the held-out
ones, and any --eval-data pairs) goes through the reference once, batch by batch on the run's
mesh; each row's figure (the sum of its response tokens' log-probs, or their mean under
`--dpo-loss ipo`: what the loss reads) is kept on the host, 4 B per row, and every later batch
carries it (spmd.io.pairs, batch[REFERENCE_CACHE]). So the step runs no reference forward (6 N
per token instead of 8 N), and a full fine-tune's step holds no reference copy: the copy is
read onto a forward-only program of its own here and dropped before training.

The reference is what the in-step reference would be: LoRA's frozen base from the run's own
state (a resume's is the checkpoint's, hash-checked), or the --dpo-reference model read again
from the flag. A resumed run computes the figures again (one forward over the data), so
nothing is stored beside the checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmd.io import data, pairs

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyProgram
    from spmd.sections import Config


def wanted(cfg: Config) -> bool:
    """Whether run `cfg` reads its DPO reference log-probs with the data."""
    return cfg.preference.dpo_precompute_reference


def mark(cfg: Config, windows: Any) -> Any:
    """`windows` as run `cfg` reads them: pair windows whose batches carry the reference
    log-probs under --dpo-precompute-reference (filled by `fill`), anything else as it is."""
    if wanted(cfg) and isinstance(windows, pairs.PairWindows):
        return dataclasses.replace(windows, cached_reference=True)
    return windows


def fill(cfg: Config, program: AnyProgram, params: Any, sets: list[Any], say: Any) -> None:
    """Compute the reference log-prob of every row of the pair windows in `sets` (those
    `mark` marked) on run `cfg`'s mesh and keep them in each one's `reference`. `params`: the
    run's state params (LoRA's base is their frozen part); `say` prints the one line saying
    what was computed and how long it took."""
    marked = [w for w in sets if isinstance(w, pairs.PairWindows) and w.cached_reference]
    if not wanted(cfg) or not marked:
        return
    started = time.perf_counter()
    forward, weights, sharding = _reference_forward(cfg, program, params)
    rows = 0
    for windows in marked:
        plain = dataclasses.replace(windows, cached_reference=False)
        windows.reference = _row_logps(forward, weights, plain, cfg.run.batch, sharding)
        rows += windows.n_windows
    source = cfg.preference.dpo_reference or "LoRA's frozen base"
    say(
        f"DPO: the reference log-probs of {rows} sequences ({rows // 2} pairs) from {source} "
        f"computed once in {time.perf_counter() - started:.1f} s; the step runs no reference "
        f"forward (--dpo-precompute-reference)"
    )


def _reference_forward(cfg: Config, program: AnyProgram, params: Any) -> tuple[Any, Any, Any]:
    """(jitted (params, batch) -> each row's reference log-prob, replicated; those params; the
    batch sharding): on LoRA's base in the run's state, or on the --dpo-reference model read
    onto a forward-only program of the run's precision and layout."""
    from models import family
    from spmd import dpo_reference
    from spmd.engine import objectives
    from spmd.observe.observer import model_metrics
    from spmd.run import builder
    from spmd.sections import LoraConfig, PreferenceConfig

    knobs = cfg.preference
    per_row = objectives.get(cfg.run.objective).reference
    assert per_row is not None  # the builder refuses the flag for an objective without one
    logps = per_row(family.of(cfg.model), knobs)
    if not knobs.dpo_reference:  # LoRA: the base, adapters off (models/lora.py's `frozen`)
        forward = model_metrics(program, lambda model, batch: logps(model.frozen, batch))
        return forward, params, program.layout.batch_sharding()
    plain = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, objective="next_token"),
        lora=LoraConfig(),
        preference=PreferenceConfig(),
    )
    reference = builder.program(plain, program.layout.mesh, train=False)
    weights = dpo_reference.read(knobs.dpo_reference, reference.abstract_params)
    return model_metrics(reference, logps), weights, reference.layout.batch_sharding()


def _row_logps(
    forward: Any, params: Any, windows: pairs.PairWindows, batch: int, sharding: Any
) -> np.ndarray:
    """float32 [windows.n_windows]: `forward` over every row, `batch` rows at a time (the
    last batch filled up with row 0, its extra figures dropped)."""
    out = np.zeros(windows.n_windows, np.float32)
    for start in range(0, windows.n_windows, batch):
        ids = np.arange(start, min(start + batch, windows.n_windows))
        padded = np.concatenate([ids, np.zeros(batch - len(ids), np.int64)])
        figures = forward(params, data.global_batch(windows, padded, sharding))  # type: ignore[arg-type]
        out[ids] = np.asarray(jax.device_get(figures.addressable_data(0)))[: len(ids)]
    return out
