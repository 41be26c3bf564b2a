"""The preference objectives' registry records: DPO (Rafailov et al. 2023, with cDPO's label
smoothing), IPO (Azar et al. 2023) as DPO's `--dpo-loss ipo`, and ORPO (Hong et al. 2024), in
TRL's conventions so that their numbers and curves compare with TRL's (the math:
spmd.engine.preference_loss, imported when a run builds its loss: this module, like the
registry, imports no jax).

Their batches are pairs (spmd.io.pairs). DPO's reference log-probs arrive in batch[REFERENCE]
(spmd.engine.objective): the builder runs `reference_logps` on the reference model (LoRA's
frozen base, adapters off) inside the step. Neither runs under pp > 1 yet (exit 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from spmd.engine.objective import FamilyLosses, Objective
from spmd.errors import UsageError
from spmd.sections import PreferenceConfig


def check(knobs: PreferenceConfig) -> None:
    """UsageError (one line) for a preference knob that is not valid."""
    if not (knobs.dpo_beta > 0 and math.isfinite(knobs.dpo_beta)):
        raise UsageError(f"--dpo-beta {knobs.dpo_beta} must be positive and finite (e.g. 0.1)")
    if not 0 <= knobs.dpo_label_smoothing < 0.5:
        raise UsageError(f"--dpo-label-smoothing {knobs.dpo_label_smoothing} must be in [0, 0.5)")
    if knobs.dpo_loss not in ("sigmoid", "ipo"):
        raise UsageError(f"--dpo-loss {knobs.dpo_loss!r} is not one of sigmoid, ipo")
    if not (knobs.orpo_lambda > 0 and math.isfinite(knobs.orpo_lambda)):
        raise UsageError(
            f"--orpo-lambda {knobs.orpo_lambda} must be positive and finite (e.g. 0.1)"
        )


def _loss_of(terms: str) -> Callable[[FamilyLosses, PreferenceConfig], Any]:
    def make(fam: FamilyLosses, knobs: PreferenceConfig) -> Callable[[Any, dict], Any]:
        from spmd.engine import preference_loss

        check(knobs)
        fn = getattr(preference_loss, terms)
        return lambda model, batch: fn(fam, knobs, model, batch)["losses"].mean()

    return make


def _metrics_of(terms: str) -> Callable[[FamilyLosses, PreferenceConfig], Any]:
    def make(fam: FamilyLosses, knobs: PreferenceConfig) -> Callable[[Any, dict], dict]:
        from spmd.engine import preference_loss

        fn = getattr(preference_loss, terms)
        return lambda model, batch: preference_loss.figures(fn(fam, knobs, model, batch))

    return make


def reference_logps(fam: FamilyLosses, knobs: PreferenceConfig) -> Callable[[Any, dict], Any]:
    """(reference model, batch) -> its log-probs per row, as DPO's loss type reads them."""
    from spmd.engine import preference_loss

    ipo = knobs.dpo_loss == "ipo"
    return lambda model, batch: preference_loss.sequence_logps(fam, model, batch, ipo)


def _no_pipeline(name: str) -> Callable[[FamilyLosses], Callable[..., Any]]:
    def refuse(fam: FamilyLosses) -> Callable[..., Any]:
        raise UsageError(f"--objective {name} does not run under pp > 1 yet; use a mesh with pp=1")

    return refuse


DPO = Objective(
    name="dpo",
    loss=_loss_of("dpo_terms"),
    logits_loss=_no_pipeline("dpo"),
    pairs=True,
    reference=reference_logps,
    metrics=_metrics_of("dpo_terms"),
)
ORPO = Objective(
    name="orpo",
    loss=_loss_of("orpo_terms"),
    logits_loss=_no_pipeline("orpo"),
    pairs=True,
    metrics=_metrics_of("orpo_terms"),
)
