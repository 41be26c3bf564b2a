"""Hugging Face Phi-3 (`Phi3ForCausalLM`, model_type "phi3") <-> the phi3 family
(models/phi3.py): config.json both ways and the tensor table with its two fused tensors.

    Hugging Face name (+ .weight)        shape                       spmd param (.T)
    model.embed_tokens                   [vocab, hid]                embed
    model.layers.{i}.self_attn.qkv_proj  [(heads + 2 kv) * hd, hid]  rows [0, heads*hd):
                                                                       blocks/attn/wq[i]
                                                                     next kv*hd: .../wk[i]
                                                                     last kv*hd: .../wv[i]
    model.layers.{i}.self_attn.o_proj    [hid, heads * hd]           blocks/attn/wo[i]
    model.layers.{i}.mlp.gate_up_proj    [2 mlp, hid]                rows [0, mlp): .../w_gate[i]
                                                                     rows [mlp, 2 mlp): .../w_up[i]
    model.layers.{i}.mlp.down_proj       [hid, mlp]                  blocks/mlp/w_down[i]
    model.layers.{i}.input_layernorm     [hid]                       blocks/attn_norm/scale[i]
    model.layers.{i}.post_attention_layernorm [hid]                  blocks/mlp_norm/scale[i]
    model.norm                           [hid]                       final_norm/scale
    lm_head                              [vocab, hid]                lm_head (absent if tied)

transformers slices qkv_proj's output at heads * hd and heads * hd + kv * hd, and chunks
gate_up_proj's in two halves, gate first (act(gate) * up): the table lists the parts in that
order, and models/hf_tensors.py concatenates them along HF's first dim in table order.

config.json fields and what becomes of them:

    vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads (default: heads), head_dim (default hidden / heads), rms_norm_eps
    (default 1e-5, Phi3Config's), tie_word_embeddings, rope theta   as the Llama's
    (models/hf_config.dense_config)
    sliding_window         every layer's window (transformers 5 masks it in all of them); null: 0
    rope_parameters / rope_scaling   rope_type "default", or "longrope" (its old names "su"
                           and "yarn" too: Phi-3.5-mini, the 128k models): short_factor and
                           long_factor -> rope_short_factors / rope_long_factors (text, as a
                           run's config holds only numbers and text), factor (default
                           max_position_embeddings / original_max_position_embeddings) ->
                           rope_factor, attention_factor (default sqrt(1 + ln factor / ln
                           original), 1 for factor <= 1) -> rope_attention_factor;
                           partial_rotary_factor 1 only
    resid_pdrop, embd_pdrop, attention_dropout   0 only: they change training alone, and spmd
                           trains without dropout, so a non-zero rate exits 2 rather than be
                           dropped without a word (every released Phi-3 and 3.5 config has 0)
    original_max_position_embeddings   longrope's L (it wins over rope_parameters', as in
                           transformers' Phi3Config; default 4096) -> rope_original_max_positions
    max_position_embeddings   read for longrope's default factor only; written as the
                           export's max positions (longrope: L x factor, so that transformers 4,
                           which derives the attention factor from it, agrees)
    bos / eos / pad_token_id   not read (spmd.io.eos reads the eos ids); written as null,
                           since Phi3Config's defaults (32000) would not even fit a smaller
                           vocabulary
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from models.hf_config import config_json, dense_config, positive_number, rope_parameters
from models.hf_tensors import Rule
from models.rope import factors
from spmd.errors import UsageError

if TYPE_CHECKING:
    from models.phi3 import Phi3Config

ARCHITECTURE = "Phi3ForCausalLM"
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attention_dropout")
QKV = "model.layers.{}.self_attn.qkv_proj.weight"
GATE_UP = "model.layers.{}.mlp.gate_up_proj.weight"

# (spmd param path, HF name ("{}" = layer), in_dims) as models/hf_config.TENSORS; the rules of
# one HF name are the parts of a fused tensor, in the order of its rows.
TENSORS: tuple[Rule, ...] = (
    (("embed",), "model.embed_tokens.weight", 0),
    (("blocks", "attn", "wq"), QKV, 1),
    (("blocks", "attn", "wk"), QKV, 1),
    (("blocks", "attn", "wv"), QKV, 1),
    (("blocks", "attn", "wo"), "model.layers.{}.self_attn.o_proj.weight", 2),
    (("blocks", "mlp", "w_gate"), GATE_UP, 1),
    (("blocks", "mlp", "w_up"), GATE_UP, 1),
    (("blocks", "mlp", "w_down"), "model.layers.{}.mlp.down_proj.weight", 1),
    (("blocks", "attn_norm", "scale"), "model.layers.{}.input_layernorm.weight", 0),
    (("blocks", "mlp_norm", "scale"), "model.layers.{}.post_attention_layernorm.weight", 0),
    (("final_norm", "scale"), "model.norm.weight", 0),
    (("lm_head",), "lm_head.weight", 1),
)


def config_fields(hf: dict[str, Any], where: str, remat: str = "none") -> dict[str, Any]:
    """The phi3 family's config fields of a Phi3ForCausalLM config.json (as a dict);
    UsageError naming any field whose value spmd does not compute."""
    others = [a for a in hf.get("architectures") or () if a != ARCHITECTURE]
    if others:
        raise UsageError(f"{where}: architectures {others} mixed with {ARCHITECTURE}")
    rope = longrope_fields(hf, where)
    for key in DROPOUTS:
        rate = hf.get(key) or 0.0
        if rate:
            raise UsageError(
                f"{where}: {key} = {rate!r} (dropout in training) is not supported; spmd "
                f"trains without dropout (0.0)"
            )
    window = hf.get("sliding_window")
    if window is not None and not (
        isinstance(window, int) and not isinstance(window, bool) and window >= 1
    ):
        raise UsageError(f"{where}: sliding_window = {window!r} must be a positive integer or null")
    # Phi-3 reads no attention_bias / mlp_bias (it has no biases): not the Llama's to refuse
    shared = {k: v for k, v in hf.items() if k not in ("attention_bias", "mlp_bias")}
    shared.update(sliding_window=None, rms_norm_eps=hf.get("rms_norm_eps", 1e-5))
    if rope:  # the Llama reads theta and partial_rotary_factor of a default rope
        rotary = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = rotary.get("rope_theta", hf.get("rope_theta", 10000.0))
        partial = rotary.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        shared.update(rope_scaling=None, partial_rotary_factor=partial)
        shared["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    dense = dense_config(shared, where, remat, ARCHITECTURE)
    fields = dataclasses.asdict(dense) | {"family": "phi3", "sliding_window": window or 0}
    return fields | rope


def longrope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The phi3 config's LongRoPE fields of a config.json ({} for the default rope);
    UsageError for another rope type (Phi3ForCausalLM knows no other) or missing numbers."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):  # dense_config's rope_fields names it
        return {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return {}
    if rope_type not in ("longrope", "su", "yarn"):  # transformers reads the last two as longrope
        raise UsageError(
            f"{where}: rope type {rope_type!r} (rope scaling) is not supported for "
            f"{ARCHITECTURE}; it computes rope_type 'default' or 'longrope'"
        )
    lists: dict[str, list] = {}
    for key in ("short_factor", "long_factor"):
        values = rope.get(key)
        if not (isinstance(values, list) and values and all(map(positive_number, values))):
            raise UsageError(
                f"{where}: rope type {rope_type!r} needs {key}, a list of positive numbers, in "
                f"rope_parameters / rope_scaling, not {values!r}"
            )
        lists[key] = values
    original = hf.get("original_max_position_embeddings", 4096)
    factor = rope.get("factor") or hf.get("max_position_embeddings", 4096) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = default_attention_factor(factor, original)
    for key, value in (("factor", factor), ("attention_factor", attention)):
        if not positive_number(value):
            raise UsageError(f"{where}: longrope {key} = {value!r} must be a positive number")
    return {
        "rope_scaling": "longrope",
        "rope_short_factors": ",".join(repr(float(v)) for v in lists["short_factor"]),
        "rope_long_factors": ",".join(repr(float(v)) for v in lists["long_factor"]),
        "rope_factor": float(factor),
        "rope_attention_factor": float(attention),
        "rope_original_max_positions": original,
    }


def longrope_parameters(cfg: Phi3Config) -> dict[str, Any]:
    """config.json's rope_parameters of a LongRoPE config (transformers 5's spelling)."""
    return {
        "rope_type": "longrope",
        "rope_theta": cfg.rope_theta,
        "short_factor": list(factors(cfg.rope_short_factors)),
        "long_factor": list(factors(cfg.rope_long_factors)),
        "factor": cfg.rope_factor,
        "attention_factor": cfg.rope_attention_factor,
        "original_max_position_embeddings": cfg.rope_original_max_positions,
        "partial_rotary_factor": 1.0,
    }


def hf_config(cfg: Phi3Config, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of phi3 config `cfg` as a Phi3ForCausalLM, readable by transformers 4
    and 5."""
    longrope = cfg.rope_scaling == "longrope"
    original = cfg.rope_original_max_positions if longrope else max_positions
    config = config_json(  # head_dim among the sizes: Phi3Attention reads it where given
        cfg,
        ARCHITECTURE,
        "phi3",
        dtype,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,  # transformers 4 reads this, 5 the rope_parameters
        rope_parameters=(
            longrope_parameters(cfg)
            if longrope
            else rope_parameters(cfg) | {"partial_rotary_factor": 1.0}
        ),
        tie_word_embeddings=cfg.tie_embeddings,
        sliding_window=cfg.sliding_window or None,
        max_position_embeddings=round(original * cfg.rope_factor) if longrope else max_positions,
        original_max_position_embeddings=original,
        **dict.fromkeys(DROPOUTS, 0.0),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if longrope:  # transformers 5's Phi3Config reads this before rope_parameters, as 4 does
        rope = config["rope_parameters"]
        config["rope_scaling"] = {"type": "longrope"} | {
            k: rope[k] for k in ("short_factor", "long_factor")
        }  # early transformers 4 takes these three keys alone, and derives the attention factor
        if cfg.rope_attention_factor != default_attention_factor(cfg.rope_factor, original):
            config["rope_scaling"] |= {k: rope[k] for k in ("factor", "attention_factor")}
    return config


def default_attention_factor(factor: float, original: int) -> float:
    """LongRoPE's cos and sin scale when config.json gives none (transformers' rule)."""
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
