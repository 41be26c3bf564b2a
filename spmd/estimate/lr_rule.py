"""The peak learning rate spmd.plan suggests for the model it plans when --lr is not given.

The --lr default (spmd.sections.OptimizerConfig) was tuned for the small preset, 128 wide; an
8 B model diverges at it. AdamW's stable peak rate falls about as 1 / width, so the planner
suggests

    peak lr = BASE[regime] x 4096 / embed_dim, never above the --lr default,

with a base read off published runs of 4096-wide models, by what the run trains:

- pretraining 3e-4: Llama 3 8B's peak rate (The Llama 3 Herd of Models, 2024); the rule then
  gives 70B (8192 wide) 1.5e-4 and 405B (16384) 7.5e-5, where Meta used 1.5e-4 and 8e-5;
- LoRA 2e-4: QLoRA's rate for 7B and 13B LLaMA (Dettmers et al. 2023; 1e-4 for 33B and 65B,
  where the rule gives 1.2e-4 and 1e-4);
- a full fine-tune from --init-from-hf 2e-5: Stanford Alpaca's rate for LLaMA 7B (1e-5 for
  13B, where the rule gives 1.6e-5).

A starting point for a sweep, not a tuned value: the data, batch and schedule move the best
rate. Units: learning rates are per optimizer update, widths in features.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spmd.engine.optim import peak_lr

REFERENCE_WIDTH = 4096
BASE = {"pretraining": 3e-4, "LoRA": 2e-4, "full fine-tune": 2e-5}


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """The peak rate the rule gives a model, and how it was reached."""

    peak_lr: float
    regime: str  # a key of BASE
    rule: str  # e.g. "3e-4 x 4096 / embed 4096 (pretraining)"


def regime(lora_rank: int, from_hf: bool) -> str:
    """What the run trains: adapters (LoRA), all of a loaded model, or a model from scratch."""
    if lora_rank:
        return "LoRA"
    return "full fine-tune" if from_hf else "pretraining"


def suggest(embed_dim: int, kind: str, default_lr: float) -> Suggestion:
    """The rule's peak rate for a model `embed_dim` wide trained as `kind` (a key of BASE),
    capped at `default_lr`, rounded to 2 significant digits."""
    base = BASE[kind]
    raw = base * REFERENCE_WIDTH / embed_dim
    rule = f"{base:.0e} x {REFERENCE_WIDTH} / embed {embed_dim} ({kind})".replace("e-0", "e-")
    if raw >= default_lr:
        return Suggestion(default_lr, kind, f"{rule}, capped at the --lr default {default_lr:g}")
    return Suggestion(float(f"{raw:.2g}"), kind, rule)


def lr_for_peak(optimizer: Any, peak: float, global_batch: int) -> float:
    """The --lr whose peak after --lr-scaling (spmd.engine.optim.peak_lr: linear in --lr) at
    `global_batch` is `peak`."""
    return float(f"{peak * optimizer.lr / peak_lr(optimizer, global_batch):.3g}")
