"""What a training objective is: the record an objective fills in (`Objective`), what it may
read of a model family (`FamilyLosses`), and the default one, next-token prediction.

An objective turns a family's pieces into the loss a run minimises: `(model, batch) -> mean
loss` (fp32 scalar) for the step, and the last pipeline stage's `(logits, targets[, weights])
-> mean loss` when pp > 1. The builder (spmd/run/builder.py) reads it from the registry
(spmd.engine.objectives) by the run's --objective and wraps it for LoRA as it wraps the
family's own loss. The family arrives as an argument, so this module imports no model, and no
jax either: every command's [run] section names an objective, and the resolver checks it here.

A preference objective (spmd.engine.preference) says more: its batches are pairs (`pairs`),
it may read a reference model's figures from the batch (`reference`: computed by the builder
on LoRA's frozen base, under REFERENCE), and it logs figures of its own (`metrics`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from spmd import sections

if TYPE_CHECKING:
    import jax

    from spmd.engine.step import LossFn
    from spmd.sections import PreferenceConfig

# The batch key under which a reference objective's loss finds the reference's figures.
REFERENCE = "reference_logps"
PAIRS = sections.PAIRS  # the batch key of a pair batch's response-token mask


class FamilyLosses(Protocol):
    """What an objective reads of a model family (models.contract.Family has these)."""

    @property
    def loss(self) -> LossFn:
        """(model, batch) -> the mean next-token loss, fp32."""

    @property
    def logits_loss(self) -> Callable[..., jax.Array]:
        """A pipeline's last-stage loss: (logits, targets[, weights]) -> mean loss, fp32."""

    @property
    def token_losses(self) -> Callable[[Any, dict], jax.Array]:
        """(model, batch) -> per-target cross-entropy, fp32 [batch, length]."""


# (family, the run's [preference] section) -> (model, batch) -> a figure
Maker = Callable[[FamilyLosses, "PreferenceConfig"], Callable[[Any, dict], Any]]


@dataclasses.dataclass(frozen=True)
class Objective:
    """A training objective: its --objective name, and from a family's pieces (and the run's
    [preference] knobs) the step's loss and the last pipeline stage's."""

    name: str
    loss: Maker  # -> (model, batch) -> mean loss (fp32)
    # family -> (logits, targets[, weights]) -> mean loss (fp32): the last stage's, pp > 1
    logits_loss: Callable[[FamilyLosses], Callable[..., jax.Array]]
    pairs: bool = False  # its batches are preference pairs (rows 2i chosen, 2i + 1 rejected)
    # -> (model, batch) -> the figures batch[REFERENCE] holds, run on the reference model;
    # None: the loss reads no reference
    reference: Maker | None = None
    metrics: Maker | None = None  # -> (model, batch) -> {name: fp32 scalar} each logged step


def _family_loss(fam: FamilyLosses, knobs: PreferenceConfig) -> LossFn:
    return fam.loss


def _family_logits_loss(fam: FamilyLosses) -> Callable[..., jax.Array]:
    return fam.logits_loss


# Next-token prediction: the family's own cross-entropy (nats per target token; the batch's
# "weights" mask prompts out and its "segments" keep documents apart, as the data gives them).
NEXT_TOKEN = Objective(name="next_token", loss=_family_loss, logits_loss=_family_logits_loss)
