"""The Llama family's Hugging Face mapping: `config.json` <-> LlamaConfig for the
architectures it runs, and its tensor table (models/hf_io.py streams the tensors).

    LlamaForCausalLM     Llama 2 / 3.x (rope scaling `llama3` or `linear`)
    MistralForCausalLM   a sliding window (`sliding_window`) -> LlamaConfig.sliding_window
    Qwen2ForCausalLM     Qwen2 / Qwen2.5: biases on q, k, v -> qkv_bias
    Qwen3ForCausalLM     per-head RMS norms on q and k -> qk_norm, an explicit head_dim

Reads the spellings of transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`);
defaults follow transformers' configs (kv heads = heads, head_dim = hidden / heads, RMSNorm eps
1e-6, untied). Anything the spmd Llama does not compute (another architecture, a rope type
other than default / linear / llama3, a bias on the output projection or the MLP, Qwen's
per-layer sliding windows, another activation) is a UsageError naming it.

The tensors:

    Hugging Face name (+ .weight)     shape            spmd param            conversion
    model.embed_tokens                [vocab, hid]     embed                 as is
    model.layers.{i}.self_attn.q_proj [heads*hd, hid]  blocks/attn/wq[i]     .T -> [hid, heads, hd]
    model.layers.{i}.self_attn.k_proj [kv*hd, hid]     blocks/attn/wk[i]     .T -> [hid, kv, hd]
    model.layers.{i}.self_attn.v_proj [kv*hd, hid]     blocks/attn/wv[i]     .T -> [hid, kv, hd]
    model.layers.{i}.self_attn.o_proj [hid, heads*hd]  blocks/attn/wo[i]     .T -> [heads, hd, hid]
    model.layers.{i}.mlp.gate_proj    [mlp, hid]       blocks/mlp/w_gate[i]  .T
    model.layers.{i}.mlp.up_proj      [mlp, hid]       blocks/mlp/w_up[i]    .T
    model.layers.{i}.mlp.down_proj    [hid, mlp]       blocks/mlp/w_down[i]  .T
    model.layers.{i}.input_layernorm  [hid]            blocks/attn_norm/scale[i]
    model.layers.{i}.post_attention_layernorm [hid]    blocks/mlp_norm/scale[i]
    model.norm                        [hid]            final_norm/scale
    lm_head                           [vocab, hid]     lm_head               .T (absent if tied)

and where the config has them (Qwen2's biases, Qwen3's per-head norms):

    model.layers.{i}.self_attn.q_proj.bias  [heads*hd]  blocks/attn/bq[i]     -> [heads, hd]
    model.layers.{i}.self_attn.k_proj.bias  [kv*hd]     blocks/attn/bk[i]     -> [kv, hd]
    model.layers.{i}.self_attn.v_proj.bias  [kv*hd]     blocks/attn/bv[i]     -> [kv, hd]
    model.layers.{i}.self_attn.q_norm       [hd]        blocks/attn/q_norm/scale[i]
    model.layers.{i}.self_attn.k_norm       [hd]        blocks/attn/k_norm/scale[i]

Grouped-query heads need nothing more: query head h reads kv head h // (heads / kv_heads) in
both.
"""

from __future__ import annotations

import math
from typing import Any

from models import llama
from models.hf_tensors import FLAT, Rule
from spmd.errors import UsageError

# (spmd param path, Hugging Face name ("{}" = layer index), in_dims): HF stores a Linear as
# [out, in]; in_dims is how many leading dims of the spmd param make up `in` (0: stored as is,
# FLAT: stored as one dim).
# The embedding and attention projections, and the MLP, under the names every Llama-shaped
# architecture gives them (OLMo 2's and Gemma's tables start from them too).
EMBEDDING_ATTENTION: tuple[Rule, ...] = (
    (("embed",), "model.embed_tokens.weight", 0),
    (("blocks", "attn", "wq"), "model.layers.{}.self_attn.q_proj.weight", 1),
    (("blocks", "attn", "wk"), "model.layers.{}.self_attn.k_proj.weight", 1),
    (("blocks", "attn", "wv"), "model.layers.{}.self_attn.v_proj.weight", 1),
    (("blocks", "attn", "wo"), "model.layers.{}.self_attn.o_proj.weight", 2),
)
MLP: tuple[Rule, ...] = (
    (("blocks", "mlp", "w_gate"), "model.layers.{}.mlp.gate_proj.weight", 1),
    (("blocks", "mlp", "w_up"), "model.layers.{}.mlp.up_proj.weight", 1),
    (("blocks", "mlp", "w_down"), "model.layers.{}.mlp.down_proj.weight", 1),
)
QK_NORMS: tuple[Rule, ...] = (  # Qwen3's and Gemma 3's per-head q and k norms
    (("blocks", "attn", "q_norm", "scale"), "model.layers.{}.self_attn.q_norm.weight", 0),
    (("blocks", "attn", "k_norm", "scale"), "model.layers.{}.self_attn.k_norm.weight", 0),
)
TENSORS: tuple[Rule, ...] = (
    *EMBEDDING_ATTENTION,
    (("blocks", "attn", "bq"), "model.layers.{}.self_attn.q_proj.bias", FLAT),
    (("blocks", "attn", "bk"), "model.layers.{}.self_attn.k_proj.bias", FLAT),
    (("blocks", "attn", "bv"), "model.layers.{}.self_attn.v_proj.bias", FLAT),
    *QK_NORMS,
    *MLP,
    (("blocks", "attn_norm", "scale"), "model.layers.{}.input_layernorm.weight", 0),
    (("blocks", "mlp_norm", "scale"), "model.layers.{}.post_attention_layernorm.weight", 0),
    (("final_norm", "scale"), "model.norm.weight", 0),
    (("lm_head",), "lm_head.weight", 1),
)
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}  # the architecture of a config.json that names none
ARCHITECTURES = tuple(MODEL_TYPES.values())
QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # Qwen's windows
ROPE_TYPES = ("default", "linear", "llama3")  # rope_type -> LlamaConfig.rope_scaling below
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def architectures(hf: dict[str, Any]) -> list[str]:
    """The architectures a config.json names (from model_type when it names none)."""
    types = {**MODEL_TYPES, "mixtral": "MixtralForCausalLM"}
    return hf.get("architectures") or [
        types.get(hf.get("model_type"), f"model_type {hf.get('model_type')!r}")
    ]


def llama_config(hf: dict[str, Any], where: str, remat: str = "none") -> llama.LlamaConfig:
    """The LlamaConfig of a Hugging Face config.json (as a dict); UsageError naming any
    architecture or feature spmd's Llama does not implement."""
    names = architectures(hf)
    unsupported = [a for a in names if a not in ARCHITECTURES]
    if unsupported:
        raise UsageError(
            f"{where}: architecture {', '.join(map(str, unsupported))} is not supported; "
            f"spmd converts {', '.join(ARCHITECTURES)}, MixtralForCausalLM"
        )
    return dense_config(hf, where, remat, names[0])


def dense_config(
    hf: dict[str, Any], where: str, remat: str = "none", architecture: str = "LlamaForCausalLM"
) -> llama.LlamaConfig:
    """The LlamaConfig of the fields a Llama-family config.json shares (attention, norms,
    rope, sizes) as `architecture` reads them; UsageError naming any feature spmd lacks."""
    features = {
        "hidden_act": (hf.get("hidden_act", "silu") in ("silu", "swish"), "an MLP activation"),
        "attention_bias": (not hf.get("attention_bias", False), "biases on all four projections"),
        "mlp_bias": (not hf.get("mlp_bias", False), "biases in the MLP"),
    }
    for key, (ok, what) in features.items():
        if not ok:
            raise UsageError(f"{where}: {key} = {hf[key]!r} ({what}) is not supported")
    missing = [
        key
        for key in ("vocab_size", "hidden_size", "intermediate_size")
        + ("num_hidden_layers", "num_attention_heads")
        if not isinstance(hf.get(key), int)
    ]
    if missing:
        raise UsageError(f"{where} has no integer {', '.join(missing)}; is it a Llama config?")
    rope = rope_fields(hf, where)
    check_numbers(hf, where, rope["rope_theta"])
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UsageError(f"{where}: num_key_value_heads {kv_heads} does not divide {heads} heads")
    cfg = llama.LlamaConfig(
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        mlp_dim=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        remat=remat,
        qkv_bias=architecture == "Qwen2ForCausalLM",  # Qwen2 always has them
        qk_norm=architecture == "Qwen3ForCausalLM",  # Qwen3 always has them
        sliding_window=sliding_window(hf, where, architecture),
        **rope,
    )
    llama.check(cfg)  # what check_numbers leaves (an odd head_dim), named by the model's flags
    return cfg


def sliding_window(hf: dict[str, Any], where: str, architecture: str) -> int:
    """The sliding window of every layer (0: none). Mistral's `sliding_window` applies to all
    layers; Qwen's applies only with `use_sliding_window` and then to the layers from
    `max_window_layers` on (`layer_types`), which spmd does not compute; Llama and Mixtral
    have none in spmd."""
    window = hf.get("sliding_window")
    if architecture in QWEN:
        sliding = hf.get("use_sliding_window") or "sliding_attention" in (
            hf.get("layer_types") or ()
        )
        if sliding:
            raise UsageError(
                f"{where}: use_sliding_window / layer_types ask for sliding-window attention in "
                f"some layers of a {architecture}, which is not supported (use_sliding_window "
                f"false is: Qwen2.5 and Qwen3 release configs have it)"
            )
        return 0  # Qwen configs carry a sliding_window value that applies to no layer
    if window is None:
        return 0
    if architecture != "MistralForCausalLM":
        raise UsageError(
            f"{where}: sliding_window = {window!r} (sliding-window attention) is not supported "
            f"for {architecture}; spmd computes it for MistralForCausalLM"
        )
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        raise UsageError(f"{where}: sliding_window = {window!r} must be a positive integer or null")
    return window


def rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """LlamaConfig's rope_* fields from config.json's `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (transformers 4); UsageError for a rope type spmd lacks or a
    scaling without its numbers."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UsageError(f"{where}: rope_parameters / rope_scaling = {rope!r} is not an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UsageError(
            f"{where}: rope type {rope_type!r} (rope scaling) is not supported; spmd implements "
            f"rope_type {', '.join(map(repr, ROPE_TYPES))}"
        )
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UsageError(
            f"{where}: partial_rotary_factor = {partial!r} (rotary on part of each head) is not "
            f"supported; spmd rotates every feature (1.0)"
        )
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {"rope_theta": theta}
    if rope_type == "default":
        return fields
    wanted = ("factor",) if rope_type == "linear" else LLAMA3_KEYS
    for key in wanted:
        if not positive_number(rope.get(key)):
            raise UsageError(
                f"{where}: rope type {rope_type!r} needs a positive number {key} in "
                f"rope_parameters / rope_scaling, not {rope.get(key)!r}"
            )
    fields.update(rope_scaling=rope_type, rope_factor=float(rope["factor"]))
    if rope_type == "llama3":
        fields.update(
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_positions=int(rope["original_max_position_embeddings"]),
        )
    return fields


# config.json's counts: each an integer >= 1 where given
COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
COUNTS += ("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_numbers(hf: dict[str, Any], where: str, rope_theta: Any) -> None:
    """UsageError naming a config.json count below 1 or a rope theta (`rope_theta`: the one
    the config gives, in rope_parameters or at the top) or RMSNorm eps that is not a positive
    finite number. None, transformers' "unset", is left to the defaults."""
    for key in COUNTS:
        value = hf.get(key)
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise UsageError(f"{where}: {key} = {value!r} must be a positive integer")
    for key, value in (("rope_theta", rope_theta), ("rms_norm_eps", hf.get("rms_norm_eps"))):
        if value is not None and not positive_number(value):
            raise UsageError(f"{where}: {key} = {value!r} must be a positive, finite number")


def positive_number(value: Any) -> bool:
    """Whether a JSON value is a number (not a bool) in (0, inf)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 < value < math.inf


def hf_architecture(cfg: llama.LlamaConfig) -> str:
    """The architecture that computes `cfg`: Qwen3 with q/k norms, Qwen2 with q/k/v biases,
    Mistral with a sliding window, else Llama; UsageError for a mix none of them has (Qwen3's
    attention_bias biases the output projection too; Qwen's sliding windows skip layers)."""
    if (cfg.qk_norm and cfg.qkv_bias) or ((cfg.qk_norm or cfg.qkv_bias) and cfg.sliding_window):
        raise UsageError(
            f"this model (qk_norm {cfg.qk_norm}, qkv_bias {cfg.qkv_bias}, sliding_window "
            f"{cfg.sliding_window}) has no Hugging Face architecture: Qwen3 (qk_norm) has no "
            f"q/k/v-only biases, and neither Qwen has a sliding window on every layer"
        )
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    if cfg.qkv_bias:
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM"


def rope_parameters(cfg: llama.LlamaConfig) -> dict[str, Any]:
    """config.json's rope_parameters of `cfg` (transformers 5's spelling)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "none":
        return rope
    rope.update(rope_type=cfg.rope_scaling, factor=cfg.rope_factor)
    if cfg.rope_scaling == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_positions,
        )
    return rope


def config_json(
    cfg: Any, architecture: str, model_type: str, dtype: str, **fields: Any
) -> dict[str, Any]:
    """The config.json every family writes (as a dict, in the order written): its
    architecture and model_type, the sizes of a Llama-shaped config `cfg` (vocab_size,
    hidden_size, intermediate_size, layers, heads, kv heads, head_dim), the family's own
    `fields` in the order given, and the dtype `dtype` under transformers 4's and 5's names.
    Values keep the Python types transformers declares (tests/test_hf_config_types.py)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        **fields,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def hf_config(cfg: llama.LlamaConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of `cfg` as the architecture that computes it (`hf_architecture`),
    readable by transformers 4 and 5."""
    architecture = hf_architecture(cfg)
    rope = rope_parameters(cfg)
    config = config_json(
        cfg,
        architecture,
        next(t for t, a in MODEL_TYPES.items() if a == architecture),
        dtype,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,  # transformers 4 reads this, 5 the rope_parameters
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=max_positions,
    )
    if cfg.rope_scaling != "none":  # transformers 4's spelling (5 reads it first: the same)
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if architecture == "LlamaForCausalLM":
        config.update(attention_bias=False, mlp_bias=False)
    elif architecture == "MistralForCausalLM":
        config.update(sliding_window=cfg.sliding_window)
    else:  # Qwen: no sliding window in any layer
        config.update(use_sliding_window=False, sliding_window=None)
        config.update(max_window_layers=cfg.n_layers)
        if architecture == "Qwen3ForCausalLM":
            config.update(attention_bias=False)
    return config
