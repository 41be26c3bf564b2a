"""Hugging Face GPT-OSS (`GptOssForCausalLM`) <-> the gpt_oss family (models/gpt_oss.py):
config.json both ways and the tensor table.

    Hugging Face name, under model.layers.{i}.  shape             spmd param under blocks/
    self_attn.{q,k,v,o}_proj.weight / .bias     as a Qwen2's, plus o_proj.bias -> attn/bo [e]
    self_attn.sinks                             [heads]           attn/sinks
    mlp.router.weight                           [E, hid]          experts/router (.T)
    mlp.router.bias                             [E]               experts/router_logit_bias
    mlp.experts.gate_up_proj                    [E, hid, 2 mlp]   experts/w_gate_up (as is;
                                                                  gate, up interleaved)
    mlp.experts.gate_up_proj_bias               [E, 2 mlp]        experts/b_gate_up
    mlp.experts.down_proj                       [E, mlp, hid]     experts/w_down (as is)
    mlp.experts.down_proj_bias                  [E, hid]          experts/b_down

(the experts' matrices are stored [in, out], unlike a Linear), and the norms, embedding and
head as a Llama's. Released checkpoints hold each expert matrix as MXFP4 `_blocks` and
`_scales` (config.json's quantization_config, quant_method mxfp4), which models/hf_io.py
reads as the fp32 matrix (models/mxfp4.py); the export writes floats and no
quantization_config.

config.json fields:

    num_local_experts (or num_experts)   n_experts
    num_experts_per_tok                  experts_per_token
    intermediate_size                    expert_mlp_dim (and mlp_dim: there is no dense MLP)
    swiglu_limit, swiglu_alpha           swiglu_limit, swiglu_alpha (transformers 5.24 reads
                                         swiglu_alpha; releases omit it: 1.702)
    sliding_window, layer_types          sliding_window, global_every (the layers must
                                         alternate with a period: full where (i + 1) % p == 0)
    rope_parameters yarn                 rope_scaling yarn, rope_factor, rope_beta_fast,
      (factor, beta_fast, beta_slow,     rope_beta_slow, rope_truncate,
      truncate, original_max_position_   rope_original_max_positions, rope_attention_factor
      embeddings, attention_factor)      (given, or YaRN's 0.1 ln(factor) + 1)
    router_aux_loss_coef                 aux_loss_coef
    the rest (sizes, rms_norm_eps, rope_theta, tie_word_embeddings)   as a Llama's

Refused, naming the field: attention_bias false (GPT-OSS always has them), a hidden_act other
than silu (the experts' clamped SwiGLU is fixed), attention_dropout, a quantization_config
other than mxfp4, layer types that do not alternate so, a rope
type other than yarn and default, YaRN's mscale / mscale_all_dim (DeepSeek's), a
partial_rotary_factor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from models.hf_config import EMBEDDING_ATTENTION, check_numbers, config_json, positive_number
from models.hf_qwen3_moe import count
from models.hf_tensors import FLAT, Rule
from spmd.errors import UsageError

if TYPE_CHECKING:
    from models.gpt_oss import GptOssConfig

ARCHITECTURE = "GptOssForCausalLM"
MODEL_TYPE = "gpt_oss"
LAYER = "model.layers.{}."

TENSORS: tuple[Rule, ...] = (
    *EMBEDDING_ATTENTION,
    (("blocks", "attn", "bq"), LAYER + "self_attn.q_proj.bias", FLAT),
    (("blocks", "attn", "bk"), LAYER + "self_attn.k_proj.bias", FLAT),
    (("blocks", "attn", "bv"), LAYER + "self_attn.v_proj.bias", FLAT),
    (("blocks", "attn", "bo"), LAYER + "self_attn.o_proj.bias", 0),
    (("blocks", "attn", "sinks"), LAYER + "self_attn.sinks", 0),
    (("blocks", "experts", "router"), LAYER + "mlp.router.weight", 1),
    (("blocks", "experts", "router_logit_bias"), LAYER + "mlp.router.bias", 0),
    (("blocks", "experts", "w_gate_up"), LAYER + "mlp.experts.gate_up_proj", 0),
    (("blocks", "experts", "b_gate_up"), LAYER + "mlp.experts.gate_up_proj_bias", 0),
    (("blocks", "experts", "w_down"), LAYER + "mlp.experts.down_proj", 0),
    (("blocks", "experts", "b_down"), LAYER + "mlp.experts.down_proj_bias", 0),
    (("blocks", "attn_norm", "scale"), LAYER + "input_layernorm.weight", 0),
    (("blocks", "mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", 0),
    (("final_norm", "scale"), "model.norm.weight", 0),
    (("lm_head",), "lm_head.weight", 1),
)
FULL, SLIDING = "full_attention", "sliding_attention"


def global_every_of(hf: dict[str, Any], where: str, n_layers: int, window: int) -> int:
    """global_every (models/gpt_oss.py) of config.json's layer_types: layer i full where
    (i + 1) % p == 0, else sliding (0: every layer sliding; 1: every layer full); transformers'
    default, where it names none, alternates (p = 2). UsageError for another pattern."""
    types = hf.get("layer_types")
    if types is None:
        types = [FULL if (i + 1) % 2 == 0 else SLIDING for i in range(n_layers)]
    if not (isinstance(types, list) and len(types) == n_layers and set(types) <= {FULL, SLIDING}):
        raise UsageError(
            f"{where}: layer_types = {types!r} must list {n_layers} layers, each "
            f"{SLIDING!r} or {FULL!r}"
        )
    if SLIDING in types and not window:
        raise UsageError(f"{where}: layer_types has sliding layers but sliding_window is unset")
    full = [i for i, t in enumerate(types) if t == FULL]
    period = full[0] + 1 if full else 0
    if period and types != [FULL if (i + 1) % period == 0 else SLIDING for i in range(n_layers)]:
        raise UsageError(
            f"{where}: layer_types = {types!r} is not supported; spmd computes full layers "
            f"every p-th layer (i + 1) % p == 0 and sliding ones between (GPT-OSS: p = 2)"
        )
    return period


def yarn_attention_factor(factor: float) -> float:
    """YaRN's cos and sin scale for a context `factor` times pretraining's, as transformers
    derives it where config.json gives none: 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The rope_* fields of config.json's rope_parameters (or transformers 4's rope_theta +
    rope_scaling): yarn or default; UsageError for another type or a field YaRN here lacks."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UsageError(f"{where}: rope_parameters / rope_scaling = {rope!r} is not an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", hf.get("rope_theta", 150000.0))
    check_numbers(hf, where, theta)
    for key in ("mscale", "mscale_all_dim", "partial_rotary_factor"):
        if rope.get(key) and not (key == "partial_rotary_factor" and rope[key] == 1):
            raise UsageError(
                f"{where}: rope_parameters {key} = {rope[key]!r} is not supported for "
                f"{ARCHITECTURE}; spmd's YaRN takes factor, beta_fast, beta_slow, truncate, "
                f"original_max_position_embeddings and attention_factor"
            )
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if kind != "yarn":
        raise UsageError(
            f"{where}: rope type {kind!r} is not supported for {ARCHITECTURE}; spmd computes "
            f"'yarn' and 'default'"
        )
    for key in ("factor", "original_max_position_embeddings"):
        if not positive_number(rope.get(key)):
            raise UsageError(
                f"{where}: rope type 'yarn' needs a positive {key}, not {rope.get(key)!r}"
            )
    factor = float(rope["factor"])
    attention = rope.get("attention_factor")
    if attention is None:  # transformers' default: YaRN's
        attention = yarn_attention_factor(factor)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise UsageError(f"{where}: rope_parameters truncate = {truncate!r} must be true or false")
    return {
        "rope_theta": float(theta),
        "rope_scaling": "yarn",
        "rope_factor": factor,
        "rope_original_max_positions": int(rope["original_max_position_embeddings"]),
        # (transformers reads a 0 or missing beta as its default: `or`)
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_truncate": truncate,
        "rope_attention_factor": float(attention),
    }


def config_fields(hf: dict[str, Any], where: str, remat: str = "none") -> dict[str, Any]:
    """The gpt_oss config's fields (models/gpt_oss.GptOssConfig) of a GPT-OSS config.json (as
    a dict); UsageError naming any field whose value spmd does not compute."""
    names = hf.get("architectures") or [ARCHITECTURE]
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE or names != [ARCHITECTURE]:
        raise UsageError(
            f"{where}: architectures {names} / model_type {hf.get('model_type')!r} is not a "
            f"{ARCHITECTURE} ({MODEL_TYPE})"
        )
    for key, wanted in (("attention_bias", True), ("hidden_act", "silu")):
        if hf.get(key, wanted) != wanted:
            raise UsageError(
                f"{where}: {key} = {hf[key]!r} is not supported for {ARCHITECTURE}; spmd "
                f"computes {wanted!r}"
            )
    quantized = hf.get("quantization_config") or {}
    if not isinstance(quantized, dict) or quantized.get("quant_method", "mxfp4") != "mxfp4":
        raise UsageError(
            f"{where}: quantization_config = {quantized!r} is not supported; spmd reads "
            f"GPT-OSS's MXFP4 experts (quant_method 'mxfp4', dequantized on import)"
        )
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise UsageError(
            f"{where}: attention_dropout = {hf['attention_dropout']!r} is not supported; spmd's "
            f"attention drops nothing (0.0)"
        )
    sizes = {
        key: count(hf, where, *keys)
        for key, keys in {
            "vocab_size": ("vocab_size",),
            "embed_dim": ("hidden_size",),
            "mlp_dim": ("intermediate_size",),
            "n_layers": ("num_hidden_layers",),
            "n_heads": ("num_attention_heads",),
            "n_experts": ("num_local_experts", "num_experts"),
            "experts_per_token": ("num_experts_per_tok",),
        }.items()
    }
    kv_heads = hf.get("num_key_value_heads") or sizes["n_heads"]
    window = hf.get("sliding_window") or 0
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
        raise UsageError(f"{where}: sliding_window = {window!r} must be a positive integer or null")
    numbers = {}
    for key, default in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        value = hf.get(key, default)
        if not positive_number(value):
            raise UsageError(f"{where}: {key} = {value!r} must be a positive, finite number")
        numbers[key] = float(value)
    aux = hf.get("router_aux_loss_coef", 0.001)
    if not (aux == 0 or positive_number(aux)):
        raise UsageError(f"{where}: router_aux_loss_coef = {aux!r} must be a finite number >= 0")
    return {
        **sizes,
        "n_kv_heads": kv_heads,
        "head_dim": hf.get("head_dim") or sizes["embed_dim"] // sizes["n_heads"],
        "expert_mlp_dim": sizes["mlp_dim"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "remat": remat,
        "sliding_window": window,
        "global_every": global_every_of(hf, where, sizes["n_layers"], window),
        **rope_fields(hf, where),
        **numbers,
        "aux_loss_coef": float(aux),
        "capacity_factor": 0.0,  # dropless, as transformers
    }


def hf_config_of(cfg: GptOssConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of a gpt_oss config as a GptOssForCausalLM, readable by transformers
    5; UsageError for a model it cannot express (no q/k/v biases, or an expert width unlike
    intermediate_size)."""
    if not cfg.qkv_bias or cfg.mlp_dim != cfg.expert_dim:
        raise UsageError(
            f"this gpt_oss model (qkv_bias {cfg.qkv_bias}, mlp_dim {cfg.mlp_dim}, expert width "
            f"{cfg.expert_dim}) has no {ARCHITECTURE} equivalent, which has biases on all four "
            f"attention projections and one intermediate_size"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=cfg.rope_factor,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            truncate=cfg.rope_truncate,
            original_max_position_embeddings=cfg.rope_original_max_positions,
        )
        if cfg.rope_attention_factor != yarn_attention_factor(cfg.rope_factor):
            rope.update(attention_factor=cfg.rope_attention_factor)  # else transformers' own

    def full(i: int) -> bool:  # models.gpt_oss_layers.layer_window's rule
        return not cfg.sliding_window or bool(cfg.global_every and (i + 1) % cfg.global_every == 0)

    return config_json(
        cfg,
        ARCHITECTURE,
        MODEL_TYPE,
        dtype,
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.experts_per_token,
        sliding_window=cfg.sliding_window or None,
        layer_types=[FULL if full(i) else SLIDING for i in range(cfg.n_layers)],
        hidden_act="silu",
        attention_bias=True,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        swiglu_limit=cfg.swiglu_limit,
        swiglu_alpha=cfg.swiglu_alpha,
        router_aux_loss_coef=cfg.aux_loss_coef,
        output_router_logits=False,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=max_positions,
    )
