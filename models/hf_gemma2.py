"""Gemma 2 and Gemma 3 (text) Hugging Face mapping: config.json <-> the fields of
models/gemma2.py's Gemma2Config (models/gemma3.py's Gemma3Config), both ways, and the tensor
table they share. The config classes build themselves from `fields(...)` (no import of them
here: models/gemma2.py imports this module).

    config.json (transformers 5; 4's spelling where it differs)     config field
    hidden_size, intermediate_size, num_hidden_layers, ...           embed_dim, mlp_dim, ...
    query_pre_attn_scalar                                            query_pre_attn_scalar
    attn_logit_softcapping, final_logit_softcapping (null: none)     attn_softcap, final_softcap
    sliding_window (null: none)                                      sliding_window
    layer_types (4: sliding_window_pattern, Gemma 3 only)            global_every: layer i full
                                                                     when (i + 1) % it == 0
    Gemma 2: rope_parameters.rope_theta (4: rope_theta)              rope_theta = rope_local_theta
    Gemma 3: rope_parameters.full_attention (4: rope_theta,          rope_theta, rope_scaling
             rope_scaling), rope_parameters.sliding_attention        (linear), rope_factor;
             (4: rope_local_base_freq)                               rope_local_theta

What the models do not compute is a UsageError naming the field: an activation other than
gelu_pytorch_tanh, biases, bidirectional attention, untied embeddings, layer_types that are
not the periodic pattern above, rope types other than default (and linear on Gemma 3's global
layers), Gemma 3 attention soft-capping (transformers 5 does not apply it either), and Gemma 3's
vision tower (vision_config; Gemma3ForConditionalGeneration is not an architecture spmd reads).

The tensors (HF name + .weight, under model.layers.{i}. for the stacked ones):

    self_attn.q_proj / k_proj / v_proj / o_proj    blocks/attn/wq, wk, wv, wo   as Llama's
    self_attn.q_norm / k_norm (Gemma 3)            blocks/attn/q_norm, k_norm/scale
    mlp.gate_proj / up_proj / down_proj            blocks/mlp/w_gate, w_up, w_down
    input_layernorm, post_attention_layernorm      blocks/attn_norm, post_attn_norm/scale
    pre_feedforward_layernorm,                     blocks/mlp_norm, post_mlp_norm/scale
    post_feedforward_layernorm
    model.embed_tokens, model.norm                 embed, final_norm/scale (no lm_head: tied)

The norm weights are stored as Gemma stores them, the offset from 1 of the (1 + w) scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from models.hf_config import (
    EMBEDDING_ATTENTION,
    MLP,
    QK_NORMS,
    check_numbers,
    config_json,
    positive_number,
    rope_fields,
)
from models.hf_tensors import Rule
from spmd.errors import UsageError

if TYPE_CHECKING:
    from models.gemma2 import Gemma2Config

TENSORS: tuple[Rule, ...] = (
    *EMBEDDING_ATTENTION,
    *QK_NORMS,
    *MLP,
    (("blocks", "attn_norm", "scale"), "model.layers.{}.input_layernorm.weight", 0),
    (("blocks", "post_attn_norm", "scale"), "model.layers.{}.post_attention_layernorm.weight", 0),
    (("blocks", "mlp_norm", "scale"), "model.layers.{}.pre_feedforward_layernorm.weight", 0),
    (("blocks", "post_mlp_norm", "scale"), "model.layers.{}.post_feedforward_layernorm.weight", 0),
    (("final_norm", "scale"), "model.norm.weight", 0),
)
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
MODEL_TYPES = {"gemma2": GEMMA2, "gemma3_text": GEMMA3}
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
SLIDING, FULL = "sliding_attention", "full_attention"


def fields(hf: dict[str, Any], where: str, remat: str, architecture: str) -> dict[str, Any]:
    """The Gemma2Config / Gemma3Config fields of config.json `hf` read as `architecture`;
    UsageError naming any field whose value the model does not compute."""
    names = hf.get("architectures") or [MODEL_TYPES.get(str(hf.get("model_type")), "")]
    if list(names) != [architecture]:
        raise UsageError(f"{where}: architectures {names} is not [{architecture!r}]")
    gemma3 = architecture == GEMMA3
    refuse(hf, where, gemma3)
    missing = [key for key in SIZES if not isinstance(hf.get(key), int)]
    if missing:
        raise UsageError(f"{where} has no integer {', '.join(missing)}; is it a Gemma config?")
    rope = gemma3_rope(hf, where) if gemma3 else gemma2_rope(hf, where)
    check_numbers(hf, where, rope["rope_theta"])
    scalar = hf.get("query_pre_attn_scalar", 256)
    if not positive_number(scalar):
        raise UsageError(f"{where}: query_pre_attn_scalar = {scalar!r} must be a positive number")
    window = hf.get("sliding_window", 4096)
    if window is not None and not (isinstance(window, int) and window >= 1):
        raise UsageError(f"{where}: sliding_window = {window!r} must be a positive integer or null")
    return {
        "vocab_size": hf["vocab_size"],
        "embed_dim": hf["hidden_size"],
        "mlp_dim": hf["intermediate_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads") or 4,  # transformers' defaults
        "head_dim": hf.get("head_dim") or 256,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "query_pre_attn_scalar": float(scalar),
        "attn_softcap": softcap(hf, where, "attn_logit_softcapping", None if gemma3 else 50.0),
        "final_softcap": softcap(hf, where, "final_logit_softcapping", None if gemma3 else 30.0),
        "sliding_window": window or 0,
        "global_every": global_every(hf, where, 6 if gemma3 else 2),
        "remat": remat,
        **rope,
    }


def refuse(hf: dict[str, Any], where: str, gemma3: bool) -> None:
    """UsageError naming a config.json field with a value neither Gemma model computes."""
    problems = {
        "hidden_activation": (
            hf.get("hidden_activation", "gelu_pytorch_tanh") == "gelu_pytorch_tanh",
            "an MLP activation other than gelu_pytorch_tanh",
        ),
        "attention_bias": (not hf.get("attention_bias"), "biases on the attention projections"),
        "use_bidirectional_attention": (
            not hf.get("use_bidirectional_attention"),
            "attention that is not causal",
        ),
        "tie_word_embeddings": (
            hf.get("tie_word_embeddings", True) is True,
            "an output head apart from the embedding",
        ),
        "vision_config": ("vision_config" not in hf, "Gemma 3's vision tower"),
        "attn_logit_softcapping": (
            not (gemma3 and hf.get("attn_logit_softcapping") is not None),
            "attention soft-capping in Gemma 3, which transformers does not apply",
        ),
    }
    for key, (ok, what) in problems.items():
        if not ok:
            raise UsageError(f"{where}: {key} = {hf.get(key)!r} ({what}) is not supported")


def softcap(hf: dict[str, Any], where: str, key: str, default: float | None) -> float:
    """A soft-capping value: null is none (0.0), absent is transformers' default."""
    value = hf.get(key, default)
    if value is None:
        return 0.0
    if not positive_number(value):
        raise UsageError(f"{where}: {key} = {value!r} must be a positive number or null")
    return float(value)


def global_every(hf: dict[str, Any], where: str, default: int) -> int:
    """The period of the local / global pattern: layer i full attention when (i + 1) % period
    is 0 (0: none). From layer_types, which must be that pattern, else from Gemma 3's
    sliding_window_pattern, else `default` (as transformers fills layer_types)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        period = hf.get("sliding_window_pattern", default) if default == 6 else default
        if not (isinstance(period, int) and period >= 1):
            raise UsageError(f"{where}: sliding_window_pattern = {period!r} must be >= 1")
        return period
    full = [i for i, kind in enumerate(types) if kind == FULL]
    period = full[0] + 1 if full else 0
    if list(types) != pattern(period, layers):
        raise UsageError(
            f"{where}: layer_types = {types!r} is not supported; spmd computes {layers} "
            f"entries of {SLIDING!r} with {FULL!r} at every n-th layer (n-1, 2n-1, ...)"
        )
    return period


def pattern(period: int, layers: int) -> list[str]:
    """layer_types of a period (0: every layer sliding)."""
    return [FULL if period and (i + 1) % period == 0 else SLIDING for i in range(layers)]


def gemma2_rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 2's one rotary base (rope_parameters or rope_theta), for both kinds of layer."""
    rope = rope_fields(hf, where)
    if "rope_scaling" in rope:
        raise UsageError(
            f"{where}: rope type {rope['rope_scaling']!r} is not supported for {GEMMA2}; "
            f"spmd implements rope_type 'default' for it"
        )
    return {"rope_theta": rope["rope_theta"], "rope_local_theta": rope["rope_theta"]}


def gemma3_rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 3's two rotary settings: rope_parameters per layer type (transformers 5), or
    rope_theta + rope_scaling for the full layers and rope_local_base_freq (transformers 4)."""
    given = hf.get("rope_parameters") or {}
    if not isinstance(given, dict):
        raise UsageError(f"{where}: rope_parameters = {given!r} is not an object")
    if FULL in given or SLIDING in given:
        full, local = given.get(FULL) or {}, given.get(SLIDING) or {}
    else:  # transformers 4's spelling
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 1e4)}
    for layers, given_type, kinds in (
        (FULL, full, ("default", "linear")),
        (SLIDING, local, ("default",)),
    ):
        kind = given_type.get("rope_type", given_type.get("type", "default"))
        if kind not in kinds:
            raise UsageError(
                f"{where}: rope type {kind!r} of the {layers} layers is not supported; spmd "
                f"implements {' and '.join(map(repr, kinds))} there"
            )
    out = rope_fields({"rope_parameters": {"rope_theta": 1e6, **full}}, f"{where} ({FULL})")
    local_fields = rope_fields({"rope_parameters": {"rope_theta": 1e4, **local}}, where)
    if not positive_number(local_fields["rope_theta"]):
        raise UsageError(f"{where}: the sliding_attention rope_theta must be a positive number")
    names = ("rope_theta", "rope_scaling", "rope_factor")
    kept: dict[str, Any] = {k: out[k] for k in names if k in out}
    return {**kept, "rope_local_theta": float(local_fields["rope_theta"])}


def config_to_hf(cfg: Gemma2Config, dtype: str, max_positions: int) -> dict[str, Any]:
    """The config.json of a Gemma2Config (family gemma2) or Gemma3Config (gemma3), readable
    by transformers 4 and 5; UsageError for a model the architecture cannot express."""
    gemma3 = cfg.family == "gemma3"
    architecture = GEMMA3 if gemma3 else GEMMA2
    if gemma3 and cfg.attn_softcap:
        raise UsageError(f"attn_softcap {cfg.attn_softcap}: {GEMMA3} has no attention soft-cap")
    if not gemma3 and (cfg.qk_norm or cfg.rope_scaling != "none"):
        raise UsageError(f"qk_norm / rope_scaling: {GEMMA2} has no q/k norms nor rope scaling")
    if not gemma3 and cfg.rope_local_theta != cfg.rope_theta:
        raise UsageError(f"rope_local_theta: {GEMMA2} has one rotary base for every layer")
    if cfg.query_pre_attn_scalar != int(cfg.query_pre_attn_scalar):
        raise UsageError(
            f"query_pre_attn_scalar {cfg.query_pre_attn_scalar}: {architecture}'s config "
            f"declares it an integer"
        )
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        full.update(rope_type="linear", factor=cfg.rope_factor)
    config = config_json(
        cfg,
        architecture,
        next(t for t, a in MODEL_TYPES.items() if a == architecture),
        dtype,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=cfg.norm_eps,
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),  # transformers: an int
        attn_logit_softcapping=cfg.attn_softcap or None,
        final_logit_softcapping=cfg.final_softcap or None,
        sliding_window=cfg.sliding_window or None,
        layer_types=pattern(cfg.global_every, cfg.n_layers),
        attention_bias=False,
        use_bidirectional_attention=False,
        tie_word_embeddings=True,
        max_position_embeddings=max_positions,
        rope_theta=cfg.rope_theta,  # transformers 4 reads this, 5 the rope_parameters
    )
    if not gemma3:
        return {**config, "rope_parameters": full}
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
    config.update(rope_parameters={FULL: full, SLIDING: local})
    config.update(rope_local_base_freq=cfg.rope_local_theta)  # transformers 4's spellings
    config.update(sliding_window_pattern=cfg.global_every)
    if cfg.rope_scaling == "linear":
        config.update(rope_scaling={"rope_type": "linear", "factor": cfg.rope_factor})
    return config
