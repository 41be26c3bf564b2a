"""The math of the preference objectives (spmd.engine.preference names them): DPO's, IPO's and
ORPO's per-pair figures and the figures TRL logs, from a family's per-target cross-entropy, in
TRL's conventions.

A batch holds pairs: row 2i is pair i's chosen sequence, row 2i + 1 its rejected one, each a
prompt then a response (spmd.io.pairs); batch["response"] (int32 0/1 [rows, length]) marks the
targets that are response tokens, the only ones that count. A sequence's log-prob is the SUM of
log p(target) over its response tokens (TRL's DPO); IPO and ORPO use the MEAN over them (TRL's
`ipo` loss type and ORPOTrainer). All in nats, fp32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spmd.engine.objective import PAIRS, REFERENCE, FamilyLosses
from spmd.parallel import hooks
from spmd.sections import REFERENCE_CACHE, PreferenceConfig


def sequence_logps(fam: FamilyLosses, model: Any, batch: dict, mean: bool) -> jax.Array:
    """log p(response | prompt) of each row, fp32 [rows]: the sum over its response tokens
    (`mean`: divided by their count, at least 1)."""
    mask = batch[PAIRS].astype(jnp.float32)
    logps = -row_sum(fam.token_losses(model, batch) * mask)
    return logps / jnp.maximum(row_sum(mask), 1.0) if mean else logps


def row_sum(x: jax.Array) -> jax.Array:
    """The sum over each row's positions of x [rows, length], fp32 [rows]: where the explicit
    executor splits a sequence over context parallelism's devices, with its other chunks'
    (a psum), marked varying again as the chunk's own sum is, so that the per-device loss is
    as the next-token loss is and its gradient the one device's (the cast transposes to a
    psum, hooks.batch_mean)."""
    own = jnp.sum(x, axis=-1)
    return hooks.vary_like(hooks.sequence_sum(own), own)


def reference_of(batch: dict) -> jax.Array:
    """The reference's log-prob of each row, fp32 [rows]: computed in the step (REFERENCE), or
    once before training and read with the data (REFERENCE_CACHE: a row's figure at its first
    position, so its sum over positions, the context chunks' too)."""
    if REFERENCE in batch:
        return batch[REFERENCE]
    return row_sum(batch[REFERENCE_CACHE])


def _pairs(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) [pairs] of a per-row figure [2 x pairs]."""
    both = rows.reshape(-1, 2)
    return both[:, 0], both[:, 1]


def dpo_terms(fam: FamilyLosses, knobs: PreferenceConfig, model: Any, batch: dict) -> dict:
    """DPO's per-pair figures: "losses" and the implicit rewards beta x (policy - reference)
    log-prob of the chosen and the rejected response, and the policy's log-probs."""
    ipo = knobs.dpo_loss == "ipo"
    chosen, rejected = _pairs(sequence_logps(fam, model, batch, mean=ipo))
    ref_chosen, ref_rejected = _pairs(reference_of(batch))
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    beta, smooth = knobs.dpo_beta, knobs.dpo_label_smoothing
    if ipo:
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        # cDPO: a share `smooth` of the labels is taken to be flipped
        losses = -jax.nn.log_sigmoid(beta * margin) * (1.0 - smooth)
        losses = losses - jax.nn.log_sigmoid(-beta * margin) * smooth
    rewards = (
        beta * jax.lax.stop_gradient(chosen - ref_chosen),
        beta * jax.lax.stop_gradient(rejected - ref_rejected),
    )
    return {"losses": losses, "rewards": rewards, "logps": (chosen, rejected)}


def orpo_terms(fam: FamilyLosses, knobs: PreferenceConfig, model: Any, batch: dict) -> dict:
    """ORPO's figures: the chosen responses' NLL (the mean over all their tokens in the batch,
    as TRL's cross-entropy), the per-pair odds-ratio term lambda x log sigmoid(log odds) on
    mean log-probs, the rewards lambda x mean log-prob, and those log-probs."""
    mask = batch[PAIRS].astype(jnp.float32)
    token_losses = fam.token_losses(model, batch) * mask
    sums, tokens = row_sum(token_losses), row_sum(mask)
    chosen, rejected = _pairs(-sums / jnp.maximum(tokens, 1.0))
    chosen_sum, _ = _pairs(sums)
    chosen_count, _ = _pairs(tokens)
    nll = jnp.sum(chosen_sum) / jnp.maximum(jnp.sum(chosen_count), 1.0)
    # log odds(p) = log p - log(1 - p), on the mean log-prob as TRL's ORPOTrainer
    log_odds = (chosen - rejected) - (jnp.log1p(-jnp.exp(chosen)) - jnp.log1p(-jnp.exp(rejected)))
    lam = knobs.orpo_lambda
    ratio = jax.nn.log_sigmoid(log_odds)
    rewards = (lam * jax.lax.stop_gradient(chosen), lam * jax.lax.stop_gradient(rejected))
    return {
        "nll": nll,
        "ratio": ratio,
        "log_odds": log_odds,
        "losses": nll - lam * ratio,
        "rewards": rewards,
        "logps": (chosen, rejected),
    }


def figures(terms: dict) -> dict[str, jax.Array]:
    """TRL's logged figures of a batch: the means over its pairs."""
    chosen, rejected = terms["rewards"]
    out = {
        "rewards/chosen": jnp.mean(chosen),
        "rewards/rejected": jnp.mean(rejected),
        "rewards/accuracies": jnp.mean((chosen > rejected).astype(jnp.float32)),
        "rewards/margins": jnp.mean(chosen - rejected),
        "logps/chosen": jnp.mean(jax.lax.stop_gradient(terms["logps"][0])),
        "logps/rejected": jnp.mean(jax.lax.stop_gradient(terms["logps"][1])),
    }
    if "nll" in terms:
        out["nll_loss"] = terms["nll"]
        out["log_odds_ratio"] = jnp.mean(terms["ratio"])
        out["log_odds_chosen"] = jnp.mean(terms["log_odds"])
    return out
