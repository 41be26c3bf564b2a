"""Hugging Face Qwen3-MoE (`Qwen3MoeForCausalLM`) <-> the qwen3_moe family (models/qwen3_moe.py):
config.json both ways and the expert tensors. Attention (with Qwen3's per-head q/k norms),
norms, embedding and head are named and stored as in Qwen3, so the table is
hf_config.TENSORS plus this one's (the dense MLP rules there find no param and give nothing).

    Hugging Face name (+ .weight), under model.layers.{i}.  shape           spmd param (.T)
    mlp.gate                                  [E, hid]        blocks/experts/router[i]
    mlp.experts.{j}.gate_proj                 [moe_mlp, hid]  blocks/experts/w_gate[i, j]
    mlp.experts.{j}.up_proj                   [moe_mlp, hid]  blocks/experts/w_up[i, j]
    mlp.experts.{j}.down_proj                 [hid, moe_mlp]  blocks/experts/w_down[i, j]

These per-expert names are what released checkpoints hold and what transformers 5 writes
(it fuses gate and up per layer in memory and splits them again on save).

config.json fields:

    num_experts (transformers 5 also writes num_local_experts)   n_experts
    num_experts_per_tok                                          experts_per_token
    moe_intermediate_size                                        expert_mlp_dim
    intermediate_size (the dense-MLP layers', if any)              mlp_dim
    mlp_only_layers, decoder_sparse_step                         dense_layers
    norm_topk_prob                                               norm_topk_prob
    router_aux_loss_coef                                         aux_loss_coef
    the rest (sizes, rope, rms_norm_eps, tie_word_embeddings)    as Qwen3 (hf_config)

Qwen3-MoE never drops a token, so the model runs dropless (capacity_factor 0) and has no
router z-loss (z_loss_coef 0). Dense layers between the sparse ones (`decoder_sparse_step`
other than 1, a non-empty `mlp_only_layers`) become `dense_layers` (their dense MLP is
`intermediate_size` wide, named as a Qwen3's `mlp.*_proj`); the export writes them as
`mlp_only_layers` with `decoder_sparse_step` 1. Refused: `num_experts` 0 (a dense Qwen3), a
sliding window (`use_sliding_window`), attention biases and rope types spmd lacks (hf_config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from models.hf_config import dense_config, hf_config, positive_number
from models.hf_tensors import Rule
from models.layer_groups import layer_text
from models.moe_routing import options_set
from spmd.errors import UsageError

if TYPE_CHECKING:
    from models.qwen3_moe import Qwen3MoEConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"

# (spmd param path, HF name ("{}" = layer, then expert), in_dims), as hf_config.TENSORS
TENSORS: tuple[Rule, ...] = (
    (("blocks", "experts", "router"), "model.layers.{}.mlp.gate.weight", 1),
    (("blocks", "experts", "w_gate"), "model.layers.{}.mlp.experts.{}.gate_proj.weight", 1),
    (("blocks", "experts", "w_up"), "model.layers.{}.mlp.experts.{}.up_proj.weight", 1),
    (("blocks", "experts", "w_down"), "model.layers.{}.mlp.experts.{}.down_proj.weight", 1),
)


def count(hf: dict[str, Any], where: str, *keys: str) -> int:
    """The integer >= 1 config.json holds under the first of `keys` it has; UsageError naming
    it otherwise."""
    key = next((k for k in keys if k in hf), keys[0])
    value = hf.get(key)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise UsageError(f"{where}: {key} = {value!r} must be a positive integer")
    return value


def dense_layers_of(hf: dict[str, Any], where: str) -> str:
    """The dense-MLP layers of a Qwen3-MoE config.json as the config field's text
    (models/layer_groups.py): transformers makes layer i dense where i is in mlp_only_layers
    or (i + 1) % decoder_sparse_step != 0; UsageError naming a field of the wrong kind."""
    n_layers = count(hf, where, "num_hidden_layers")
    step = hf.get("decoder_sparse_step", 1)
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 1):
        raise UsageError(f"{where}: decoder_sparse_step = {step!r} must be a positive integer")
    listed = hf.get("mlp_only_layers") or []
    if not (isinstance(listed, list) and all(type(i) is int for i in listed)):
        raise UsageError(f"{where}: mlp_only_layers = {listed!r} must be a list of layer indices")
    if not all(0 <= i < n_layers for i in listed):
        raise UsageError(
            f"{where}: mlp_only_layers = {listed!r} must name layers from 0 to {n_layers - 1}"
        )
    dense = {i for i in range(n_layers) if i in listed or (i + 1) % step}
    if len(dense) == n_layers:
        raise UsageError(
            f"{where}: decoder_sparse_step = {step} and mlp_only_layers = {listed!r} leave no "
            f"sparse layer; a dense Qwen3 is Qwen3ForCausalLM"
        )
    return layer_text(sorted(dense))


def config_fields(hf: dict[str, Any], where: str, remat: str = "none") -> dict[str, Any]:
    """The qwen3_moe config's fields (models/qwen3_moe.Qwen3MoEConfig) of a Qwen3-MoE
    config.json (as a dict); UsageError naming any field whose value spmd does not compute."""
    names = hf.get("architectures") or [ARCHITECTURE]
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE or names != [ARCHITECTURE]:
        raise UsageError(
            f"{where}: architectures {names} / model_type {hf.get('model_type')!r} is not a "
            f"{ARCHITECTURE} ({MODEL_TYPE})"
        )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts == 0:
        raise UsageError(
            f"{where}: num_experts = 0 (every layer dense) is not supported as a "
            f"{ARCHITECTURE}; a dense Qwen3 is Qwen3ForCausalLM"
        )
    dense_layers = dense_layers_of(hf, where)
    experts = count(hf, where, "num_experts", "num_local_experts")
    per_token = count(hf, where, "num_experts_per_tok")
    if per_token > experts:
        raise UsageError(
            f"{where}: num_experts_per_tok {per_token} must be between 1 and num_experts {experts}"
        )
    normalize = hf.get("norm_topk_prob", False)
    if not isinstance(normalize, bool):
        raise UsageError(f"{where}: norm_topk_prob = {normalize!r} must be true or false")
    aux = hf.get("router_aux_loss_coef", 0.001)
    if not (aux == 0 or positive_number(aux)):
        raise UsageError(f"{where}: router_aux_loss_coef = {aux!r} must be a finite number >= 0")
    # Qwen3's attention (q/k norms always), norms and rope; Qwen's rule for sliding windows
    dense = dense_config(hf, where, remat, ARCHITECTURE)
    return {
        **{k: v for k, v in vars(dense).items() if k != "family"},
        "qk_norm": True,
        "n_experts": experts,
        "experts_per_token": per_token,
        "expert_mlp_dim": count(hf, where, "moe_intermediate_size"),
        "norm_topk_prob": normalize,
        "shared_expert": False,
        "capacity_factor": 0.0,  # dropless, as transformers
        "aux_loss_coef": float(aux),
        "z_loss_coef": 0.0,
        "dense_layers": dense_layers,
    }


def hf_config_of(cfg: Qwen3MoEConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of a qwen3_moe config as a Qwen3MoeForCausalLM, readable by
    transformers 4 and 5; UsageError for a model it cannot express. A model trained with a
    capacity factor exports as is: transformers then runs it dropless."""
    if not cfg.qk_norm or cfg.qkv_bias or cfg.sliding_window or cfg.shared_expert:
        raise UsageError(
            f"this Qwen3-MoE model (qk_norm {cfg.qk_norm}, qkv_bias {cfg.qkv_bias}, "
            f"sliding_window {cfg.sliding_window}, shared_expert {cfg.shared_expert}) has no "
            f"{ARCHITECTURE} equivalent, which needs q/k norms and none of the others"
        )
    routing = options_set(cfg)
    if routing:
        raise UsageError(
            f"this Qwen3-MoE model's routing ({', '.join(routing)}) has no {ARCHITECTURE} "
            f"equivalent; it routes by the softmax top-k"
        )
    dense = hf_config(cfg, dtype, max_positions)  # a Qwen3's fields (qk_norm)
    return {
        **dense,
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.expert_dim,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(cfg.dense_layer_set()),
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": False,
    }
