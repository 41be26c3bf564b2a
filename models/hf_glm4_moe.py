"""Hugging Face GLM-4.5 MoE (`Glm4MoeForCausalLM`) <-> the glm4_moe family (models/glm4_moe.py):
config.json both ways and the router and expert tensors. Attention (q/k/v biases, optional
per-head q/k norms), norms, embedding, head and the dense layers' MLPs are named and stored as
in a Llama / Qwen, so the table is hf_config.TENSORS plus this one's.

    Hugging Face name (+ .weight), under model.layers.{i}.   shape          spmd param (.T)
    mlp.gate                                    [E, hid]       blocks/experts/router[i]
    mlp.gate.e_score_correction_bias (no .weight)  [E]         blocks/experts/router_bias[i]
    mlp.experts.{j}.gate_proj / up_proj         [moe_mlp, hid] blocks/experts/w_gate, w_up[i, j]
    mlp.experts.{j}.down_proj                   [hid, moe_mlp] blocks/experts/w_down[i, j]
    mlp.shared_experts.gate_proj / up_proj / down_proj        blocks/experts/shared/w_*[i]

config.json fields:

    n_routed_experts (transformers 5 also num_local_experts)      n_experts
    num_experts_per_tok                                           experts_per_token
    moe_intermediate_size                                         expert_mlp_dim
    n_shared_experts x moe_intermediate_size (0: none)            shared_expert(_mlp_dim)
    n_group, topk_group, routed_scaling_factor, norm_topk_prob    the same names
    first_k_dense_replace                                         dense_layers (0 to k - 1)
    intermediate_size (the dense layers' MLP)                     mlp_dim
    attention_bias (q, k, v; never o), use_qk_norm                qkv_bias, qk_norm
    rope_parameters' partial_rotary_factor                        partial_rotary_factor
    the rest (sizes, rope theta, rms_norm_eps, tie_word_embeddings)  as a Llama (hf_config)

The router is always sigmoid-scored with a correction bias (router_score sigmoid,
router_bias); the model runs dropless with no router losses. A release's multi-token-
prediction layer (`num_nextn_predict_layers`) is skipped on import (models/hf_io.py).
Refused: rope scalings spmd lacks, an activation other than SiLU (hf_config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from models.hf_config import config_json, dense_config, positive_number, rope_parameters
from models.hf_qwen3_moe import count
from models.hf_tensors import Rule
from models.layer_groups import layer_text
from spmd.errors import UsageError

if TYPE_CHECKING:
    from models.glm4_moe import Glm4MoEConfig

ARCHITECTURE = "Glm4MoeForCausalLM"
MODEL_TYPE = "glm4_moe"
PREFIX = "model.layers.{}.mlp."

# (spmd param path, HF name ("{}" = layer, then expert), in_dims), as hf_config.TENSORS
TENSORS: tuple[Rule, ...] = (
    (("blocks", "experts", "router"), PREFIX + "gate.weight", 1),
    (("blocks", "experts", "router_bias"), PREFIX + "gate.e_score_correction_bias", 0),
    (("blocks", "experts", "w_gate"), PREFIX + "experts.{}.gate_proj.weight", 1),
    (("blocks", "experts", "w_up"), PREFIX + "experts.{}.up_proj.weight", 1),
    (("blocks", "experts", "w_down"), PREFIX + "experts.{}.down_proj.weight", 1),
    (("blocks", "experts", "shared", "w_gate"), PREFIX + "shared_experts.gate_proj.weight", 1),
    (("blocks", "experts", "shared", "w_up"), PREFIX + "shared_experts.up_proj.weight", 1),
    (("blocks", "experts", "shared", "w_down"), PREFIX + "shared_experts.down_proj.weight", 1),
)


def partial_rotary(hf: dict[str, Any], where: str) -> float:
    """config.json's partial_rotary_factor (in rope_parameters, or at the top level as
    transformers 4 wrote it; transformers' GLM-4.5 default 0.5 where neither has it)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    value = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    if not (positive_number(value) and value <= 1):
        raise UsageError(f"{where}: partial_rotary_factor = {value!r} must be in (0, 1]")
    return float(value)


def flag(hf: dict[str, Any], where: str, key: str, default: bool) -> bool:
    """config.json's boolean `key` (`default` where absent); UsageError for another kind."""
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key} = {value!r} must be true or false")
    return value


def config_fields(hf: dict[str, Any], where: str, remat: str = "none") -> dict[str, Any]:
    """The glm4_moe config's fields (models/glm4_moe.Glm4MoEConfig) of a GLM-4.5 config.json
    (as a dict); UsageError naming any field whose value spmd does not compute."""
    names = hf.get("architectures") or [ARCHITECTURE]
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE or names != [ARCHITECTURE]:
        raise UsageError(
            f"{where}: architectures {names} / model_type {hf.get('model_type')!r} is not a "
            f"{ARCHITECTURE} ({MODEL_TYPE})"
        )
    experts = count(hf, where, "n_routed_experts", "num_local_experts")
    per_token = count(hf, where, "num_experts_per_tok")
    if per_token > experts:
        raise UsageError(
            f"{where}: num_experts_per_tok {per_token} must be between 1 and "
            f"n_routed_experts {experts}"
        )
    shared = hf.get("n_shared_experts", 1)
    if not (isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0):
        raise UsageError(f"{where}: n_shared_experts = {shared!r} must be an integer >= 0")
    dense_first = hf.get("first_k_dense_replace", 1)
    n_layers = count(hf, where, "num_hidden_layers")
    if not (isinstance(dense_first, int) and not isinstance(dense_first, bool)) or not (
        0 <= dense_first < n_layers
    ):
        raise UsageError(
            f"{where}: first_k_dense_replace = {dense_first!r} must be an integer from 0 to "
            f"num_hidden_layers - 1 = {n_layers - 1}"
        )
    scaling = hf.get("routed_scaling_factor", 1.0)
    if not positive_number(scaling):
        raise UsageError(f"{where}: routed_scaling_factor = {scaling!r} must be a number > 0")
    # the Llama's reading of the rest, its attention biases (q, k, v here) and rotary share
    # taken apart first: hf_config refuses both, as a Llama has neither
    rope = dict(hf.get("rope_parameters") or {})
    rope.pop("partial_rotary_factor", None)
    plain = {**hf, "attention_bias": False, "rope_parameters": rope}
    plain.pop("partial_rotary_factor", None)
    dense = dense_config(plain, where, remat, ARCHITECTURE)
    expert_width = count(hf, where, "moe_intermediate_size")
    return {
        **{k: v for k, v in vars(dense).items() if k != "family"},
        "qkv_bias": flag(hf, where, "attention_bias", False),
        "qk_norm": flag(hf, where, "use_qk_norm", False),
        "partial_rotary_factor": partial_rotary(hf, where),
        "n_experts": experts,
        "experts_per_token": per_token,
        "expert_mlp_dim": expert_width,
        "shared_expert": shared > 0,
        "shared_expert_mlp_dim": shared * expert_width,
        "n_group": count(hf, where, "n_group") if "n_group" in hf else 1,
        "topk_group": count(hf, where, "topk_group") if "topk_group" in hf else 1,
        "routed_scaling_factor": float(scaling),
        "norm_topk_prob": flag(hf, where, "norm_topk_prob", True),
        "router_score": "sigmoid",
        "router_bias": True,
        "dense_layers": layer_text(list(range(dense_first))),
        "capacity_factor": 0.0,  # dropless, as transformers
        "aux_loss_coef": 0.0,
        "z_loss_coef": 0.0,
    }


def hf_config_of(cfg: Glm4MoEConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of a glm4_moe config as a Glm4MoeForCausalLM; UsageError for a model
    it cannot express (dense layers other than the first ones, softmax scores, no correction
    bias, a window, a shared expert of a width that is no multiple of the experts')."""
    dense = cfg.dense_layer_set()
    width = cfg.shared_expert_mlp_dim or cfg.expert_dim
    unexpressed = {
        "dense_layers": dense != tuple(range(len(dense))),
        "router_score": cfg.router_score != "sigmoid",
        "router_bias": not cfg.router_bias,
        "sliding_window": bool(cfg.sliding_window),
        "shared_expert_mlp_dim": cfg.shared_expert and width % cfg.expert_dim != 0,
    }
    named = [f"{field} {getattr(cfg, field)}" for field, bad in unexpressed.items() if bad]
    if named:
        raise UsageError(
            f"this glm4_moe model ({', '.join(named)}) has no {ARCHITECTURE} equivalent, which "
            f"has dense layers first only, sigmoid scores with a correction bias, no window and "
            f"shared experts of the routed experts' width"
        )
    rope = rope_parameters(cfg) | {"partial_rotary_factor": cfg.partial_rotary_factor}
    return config_json(
        cfg,
        ARCHITECTURE,
        MODEL_TYPE,
        dtype,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=max_positions,
        attention_bias=cfg.qkv_bias,
        use_qk_norm=cfg.qk_norm,
        n_routed_experts=cfg.n_experts,
        num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=cfg.expert_dim,
        n_shared_experts=width // cfg.expert_dim if cfg.shared_expert else 0,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=cfg.norm_topk_prob,
        first_k_dense_replace=len(dense),
        num_nextn_predict_layers=0,
        output_router_logits=False,
    )
