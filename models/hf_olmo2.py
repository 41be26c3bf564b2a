"""Hugging Face OLMo 2 (`Olmo2ForCausalLM`, model_type "olmo2") <-> the olmo2 family
(models/olmo2.py): config.json both ways and the tensor table.

config.json is read as a Llama's (hf_config.dense_config: the same field names and checks),
with OLMo 2's RMSNorm eps default of 1e-5:

    config.json                      Olmo2Config
    vocab_size, hidden_size          vocab_size, embed_dim
    intermediate_size                mlp_dim (SwiGLU; hidden_act must be silu)
    num_hidden_layers                n_layers
    num_attention_heads              n_heads
    num_key_value_heads              n_kv_heads (default: n_heads)
    head_dim                         head_dim (default: hidden_size / heads)
    rms_norm_eps                     norm_eps of every norm, q / k norms included (default 1e-5)
    rope_parameters / rope_theta,    rope_theta, rope_scaling (default, linear or llama3) ...
      rope_scaling                     (hf_config.rope_fields)
    tie_word_embeddings              tie_embeddings

Refused, naming the field: attention_bias true (biases on q, k, v and o), another
hidden_act, a rope type other than default / linear / llama3, partial rotary, a
sliding_window. OLMo 1's clip_qkv is ignored, as transformers' Olmo2 ignores it.

The tensors (HF stores a Linear as [out, in]):

    Hugging Face name (+ .weight)                  shape            spmd param
    model.embed_tokens                             [vocab, hid]     embed
    model.layers.{i}.self_attn.q_proj              [heads*hd, hid]  blocks/attn/wq[i]  .T
    model.layers.{i}.self_attn.k_proj              [kv*hd, hid]     blocks/attn/wk[i]  .T
    model.layers.{i}.self_attn.v_proj              [kv*hd, hid]     blocks/attn/wv[i]  .T
    model.layers.{i}.self_attn.o_proj              [hid, heads*hd]  blocks/attn/wo[i]  .T
    model.layers.{i}.self_attn.q_norm              [heads*hd]       blocks/attn/q_norm/scale[i]
                                                                      -> [heads, hd]
    model.layers.{i}.self_attn.k_norm              [kv*hd]          blocks/attn/k_norm/scale[i]
                                                                      -> [kv, hd]
    model.layers.{i}.mlp.gate_proj / up_proj       [mlp, hid]       blocks/mlp/w_gate, w_up  .T
    model.layers.{i}.mlp.down_proj                 [hid, mlp]       blocks/mlp/w_down  .T
    model.layers.{i}.post_attention_layernorm      [hid]            blocks/post_attn_norm/scale
    model.layers.{i}.post_feedforward_layernorm    [hid]            blocks/post_mlp_norm/scale
    model.norm                                     [hid]            final_norm/scale
    lm_head                                        [vocab, hid]     lm_head  .T (absent if tied)

The q / k norm scales are flat in HF, head-major (feature h * head_dim + j is head h's j-th),
the order q_proj's rows have; spmd keeps them [heads, head_dim] so that they split with the
heads.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from models.hf_config import EMBEDDING_ATTENTION, MLP, dense_config, hf_config
from models.hf_tensors import FLAT, Rule
from spmd.errors import UsageError

if TYPE_CHECKING:
    from models.olmo2 import Olmo2Config

ARCHITECTURE = "Olmo2ForCausalLM"
NORM_EPS = 1e-5  # transformers' Olmo2Config default rms_norm_eps

# (spmd param path, HF name ("{}" = layer), in_dims): models/hf_tensors.py
TENSORS: tuple[Rule, ...] = (
    *EMBEDDING_ATTENTION,
    (("blocks", "attn", "q_norm", "scale"), "model.layers.{}.self_attn.q_norm.weight", FLAT),
    (("blocks", "attn", "k_norm", "scale"), "model.layers.{}.self_attn.k_norm.weight", FLAT),
    *MLP,
    (("blocks", "post_attn_norm", "scale"), "model.layers.{}.post_attention_layernorm.weight", 0),
    (
        ("blocks", "post_mlp_norm", "scale"),
        "model.layers.{}.post_feedforward_layernorm.weight",
        0,
    ),
    (("final_norm", "scale"), "model.norm.weight", 0),
    (("lm_head",), "lm_head.weight", 1),
)


def config_fields(hf: dict[str, Any], where: str, remat: str = "none") -> dict[str, Any]:
    """The Olmo2Config fields of an OLMo 2 config.json (as a dict); UsageError naming any field
    whose value spmd does not compute."""
    others = [a for a in hf.get("architectures") or () if a != ARCHITECTURE]
    if others:
        raise UsageError(f"{where}: architectures {others} mixed with {ARCHITECTURE}")
    dense = dense_config(hf, where, remat, ARCHITECTURE)
    eps = hf.get("rms_norm_eps")
    return dataclasses.asdict(dense) | {
        "family": "olmo2",
        "norm_eps": NORM_EPS if eps is None else float(eps),
    }


def olmo2_hf_config(cfg: Olmo2Config, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of an Olmo2Config as an Olmo2ForCausalLM, readable by transformers 4
    and 5 (the Llama's fields, hf_config.hf_config, under OLMo 2's names)."""
    config = hf_config(cfg, dtype, max_positions)
    config.pop("mlp_bias")  # Olmo2Config has no such field
    return config | {
        "architectures": [ARCHITECTURE],
        "model_type": "olmo2",
        "attention_bias": False,
    }
