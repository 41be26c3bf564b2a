"""Hugging Face Mixtral (`MixtralForCausalLM`) <-> the spmd MoE model (models/moe.py): the
config.json fields and the expert tensors. Attention, norms, embedding and head are named and
stored as in Llama; the moe family's table is hf_config.TENSORS plus this one's.

    Hugging Face name (+ .weight), under model.layers.{i}.   shape        spmd param (.T)
    block_sparse_moe.gate                                     [E, hid]     blocks/experts/router[i]
    block_sparse_moe.experts.{j}.w1                           [mlp, hid]   .../w_gate[i, j]
    block_sparse_moe.experts.{j}.w3                           [mlp, hid]   .../w_up[i, j]
    block_sparse_moe.experts.{j}.w2                           [hid, mlp]   .../w_down[i, j]

Routing is the same computation in both: router logits in fp32, softmax over all E experts,
the top `num_experts_per_tok`, their weights renormalised to sum to one, output = sum of the
chosen experts' SwiGLU(x) x weight. Mixtral never drops a token, so the spmd model runs
dropless (capacity_factor 0: each expert takes every token that chose it) and the two agree to
fp32 rounding. Mixtral has no shared expert and no router z-loss (z_loss_coef 0); its
router_aux_loss_coef is the same load-balancing loss (E x sum_e f_e P_e) and becomes
aux_loss_coef. Training-time router jitter is refused, as is anything else spmd does not
compute (a sliding window, q/k/v biases, a rope type other than default, linear or llama3
...: see hf_config.dense_config).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models import moe, moe_routing
from models.hf_config import architectures, dense_config, hf_config, positive_number
from models.hf_tensors import Rule
from spmd.errors import UsageError

ARCHITECTURE = "MixtralForCausalLM"

# (spmd param path, HF name ("{}" = layer, then expert), in_dims), as hf_config.TENSORS
TENSORS: tuple[Rule, ...] = (
    (("blocks", "experts", "router"), "model.layers.{}.block_sparse_moe.gate.weight", 1),
    (("blocks", "experts", "w_gate"), "model.layers.{}.block_sparse_moe.experts.{}.w1.weight", 1),
    (("blocks", "experts", "w_up"), "model.layers.{}.block_sparse_moe.experts.{}.w3.weight", 1),
    (("blocks", "experts", "w_down"), "model.layers.{}.block_sparse_moe.experts.{}.w2.weight", 1),
)


def is_mixtral(hf: dict[str, Any]) -> bool:
    """Whether a config.json (as a dict) describes a MixtralForCausalLM."""
    return ARCHITECTURE in architectures(hf)


def mixtral_config(hf: dict[str, Any], where: str, remat: str = "none") -> moe.MoEConfig:
    """The MoEConfig of a Mixtral config.json (as a dict); UsageError naming any field whose
    value the spmd MoE model does not compute."""
    others = [a for a in architectures(hf) if a != ARCHITECTURE]
    if others:
        raise UsageError(f"{where}: architectures {others} mixed with {ARCHITECTURE}")
    jitter = hf.get("router_jitter_noise", 0.0) or 0.0
    if jitter:
        raise UsageError(
            f"{where}: router_jitter_noise = {jitter!r} (noise on the router input in "
            f"training) is not supported; spmd's router has none (0.0)"
        )
    experts = hf.get("num_local_experts")
    per_token = hf.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(per_token, int):
        raise UsageError(
            f"{where} has no integer num_local_experts / num_experts_per_tok; is it a "
            f"Mixtral config?"
        )
    if not 1 <= per_token <= experts:
        raise UsageError(
            f"{where}: num_experts_per_tok {per_token} must be between 1 and "
            f"num_local_experts {experts}"
        )
    aux = hf.get("router_aux_loss_coef", 0.001)
    if not (aux == 0 or positive_number(aux)):
        raise UsageError(f"{where}: router_aux_loss_coef = {aux!r} must be a finite number >= 0")
    dense = dense_config(hf, where, remat, ARCHITECTURE)
    cfg = moe.MoEConfig(
        **(dataclasses.asdict(dense) | {"family": "moe"}),
        n_experts=experts,
        experts_per_token=per_token,
        expert_mlp_dim=0,  # every expert is intermediate_size wide, as mlp_dim
        shared_expert=False,
        capacity_factor=0.0,  # dropless, as Mixtral
        aux_loss_coef=float(aux),
        z_loss_coef=0.0,
    )
    moe.check(cfg)  # the expert counts and weights, as a run's flags would be checked
    return cfg


def mixtral_hf_config(cfg: moe.MoEConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of `cfg` as a MixtralForCausalLM; UsageError for an MoE model Mixtral
    cannot express (a shared expert, experts of another width than mlp_dim). A model trained
    with a capacity factor exports as is: Mixtral then runs it dropless."""
    if cfg.qkv_bias or cfg.qk_norm or cfg.sliding_window:
        raise UsageError(
            f"this MoE model (qkv_bias {cfg.qkv_bias}, qk_norm {cfg.qk_norm}, sliding_window "
            f"{cfg.sliding_window}) has no Mixtral equivalent; Mixtral's attention is Llama's"
        )
    if cfg.shared_expert or cfg.expert_dim != cfg.mlp_dim or not cfg.norm_topk_prob:
        raise UsageError(
            f"this MoE model (shared_expert {cfg.shared_expert}, expert_mlp_dim "
            f"{cfg.expert_mlp_dim}, mlp_dim {cfg.mlp_dim}, norm_topk_prob "
            f"{cfg.norm_topk_prob}) has no Mixtral equivalent; Mixtral needs shared_expert "
            f"false, every expert mlp_dim wide and the top-k weights renormalised"
        )
    if cfg.dense_layers:
        raise UsageError(
            f"this MoE model's dense-MLP layers (--dense-layers {cfg.dense_layers}) have no "
            f"Mixtral equivalent; every Mixtral layer is sparse"
        )
    routing = moe_routing.options_set(cfg)
    if routing:
        raise UsageError(
            f"this MoE model's routing ({', '.join(routing)}) has no Mixtral equivalent; "
            f"Mixtral routes by the softmax top-k"
        )
    dense = hf_config(cfg, dtype, max_positions)
    return {
        **dense,
        "architectures": [ARCHITECTURE],
        "model_type": "mixtral",
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "output_router_logits": False,
    }


def moe_hf_config(cfg: moe.MoEConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of an MoE-family config: a Mixtral with experts, the dense Llama
    architecture that computes it without (n_experts 0)."""
    if cfg.n_experts:
        return mixtral_hf_config(cfg, dtype, max_positions)
    return hf_config(cfg, dtype, max_positions)
