"""Hugging Face `config.json` <-> LlamaConfig for the Llama-family architectures spmd runs.

Reads the spellings of transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`);
defaults follow transformers' LlamaConfig (kv heads = heads, head_dim = hidden / heads, RMSNorm
eps 1e-6, untied). Anything the spmd Llama does not compute (another architecture, rope
scaling, biases, sliding-window attention, another activation) is a UsageError naming it.
"""

from __future__ import annotations

import math
from typing import Any

from models import llama
from spmd.errors import UsageError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}  # if no architectures


def architectures(hf: dict[str, Any]) -> list[str]:
    """The architectures a config.json names (from model_type when it names none)."""
    types = {**MODEL_TYPES, "mixtral": "MixtralForCausalLM"}
    return hf.get("architectures") or [
        types.get(hf.get("model_type"), f"model_type {hf.get('model_type')!r}")
    ]


def llama_config(hf: dict[str, Any], where: str, remat: str = "none") -> llama.LlamaConfig:
    """The LlamaConfig of a Hugging Face config.json (as a dict); UsageError naming any
    architecture or feature spmd's Llama does not implement."""
    unsupported = [a for a in architectures(hf) if a not in ARCHITECTURES]
    if unsupported:
        raise UsageError(
            f"{where}: architecture {', '.join(map(str, unsupported))} is not supported; "
            f"spmd converts {', '.join(ARCHITECTURES)}, MixtralForCausalLM"
        )
    return dense_config(hf, where, remat)


def dense_config(hf: dict[str, Any], where: str, remat: str = "none") -> llama.LlamaConfig:
    """The LlamaConfig of the fields a Llama-family config.json shares (attention, norms,
    rope, sizes), whatever its architecture; UsageError naming any feature spmd lacks."""
    features = {
        "hidden_act": (hf.get("hidden_act", "silu") in ("silu", "swish"), "an MLP activation"),
        "attention_bias": (not hf.get("attention_bias", False), "biases in attention"),
        "mlp_bias": (not hf.get("mlp_bias", False), "biases in the MLP"),
        "sliding_window": (hf.get("sliding_window") is None, "sliding-window attention"),
    }
    for key, (ok, what) in features.items():
        if not ok:
            raise UsageError(f"{where}: {key} = {hf[key]!r} ({what}) is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UsageError(f"{where}: rope_parameters / rope_scaling = {rope!r} is not an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UsageError(
            f"{where}: rope type {rope_type!r} (rope scaling) is not supported; spmd implements "
            f"the plain rotary embedding (rope_type 'default')"
        )
    missing = [
        key
        for key in ("vocab_size", "hidden_size", "intermediate_size")
        + ("num_hidden_layers", "num_attention_heads")
        if not isinstance(hf.get(key), int)
    ]
    if missing:
        raise UsageError(f"{where} has no integer {', '.join(missing)}; is it a Llama config?")
    check_numbers(hf, where, rope.get("rope_theta", hf.get("rope_theta")))
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
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        remat=remat,
    )
    llama.check(cfg)  # what check_numbers leaves (an odd head_dim), named by the model's flags
    return cfg


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


def hf_config(cfg: llama.LlamaConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of `cfg` as a LlamaForCausalLM (readable by transformers 4 and 5)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4 reads this, 5 the rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": max_positions,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
