"""Phi-3 and Phi-3.5-mini (Hugging Face `Phi3ForCausalLM`): the Llama of models/llama.py under
another name and another tensor layout.

What Phi-3 computes is a Llama's: token embedding, pre-norm blocks of RMSNorm -> grouped-query
causal attention with "rotate half" rotary -> residual, RMSNorm -> SwiGLU MLP -> residual, a
final RMSNorm and an (untied, unless tie_word_embeddings) output head, no biases anywhere. The
differences are elsewhere:

- storage: q, k and v are one fused Linear `self_attn.qkv_proj` ([heads + 2 kv_heads] x
  head_dim rows: q's, then k's, then v's) and gate and up one `mlp.gate_up_proj` (2 mlp rows:
  the gate's, then up's). spmd keeps them as the Llama's separate params (each split by
  heads / kv_heads / mlp under tensor parallelism, as a fused tensor could not be: its rows
  mix three head counts) and splits them on import, fuses them on export (models/hf_phi3.py's
  tensor table; models/hf_tensors.py's fused rules).
- the sliding window: transformers 5 masks `sliding_window` (Phi-3-mini-4k: 2047) in every
  layer whenever config.json sets it, the band Mistral's is (models/attention.py), so it is
  LlamaConfig.sliding_window, which the ring masks under context parallelism too.
- LongRoPE (Phi-3.5-mini, the 128k models; models/rope.py): per rotated pair a divisor of its
  frequency, `short_factor`s while a forward pass's positions stay within
  original_max_position_embeddings, `long_factor`s beyond, and cos and sin scaled by an
  attention factor. transformers picks the set per forward pass, and in generation drops its
  cache and recomputes it with the long set when a sequence grows past that length; spmd's
  cached decoder cannot recompute, so generation that would cross it exits 2 (a prompt longer
  than it is fine: everything is long then). Context parallelism is refused with it (each
  device sees a part of the positions, and the set depends on the longest).
- the rest of config.json (models/hf_phi3.py): partial_rotary_factor 1 only, the dropout
  rates 0 only (spmd trains without dropout), the token ids left to generation_config.json.

So the family reuses llama.Llama, its loss and its cached decoder, with a config that says
"phi3" (the HF architecture it writes), adds LongRoPE's fields and refuses the Llama switches
Phi-3 has no counterpart of (q/k/v biases, q/k norms, rope scalings linear and llama3).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax

from models import hf_phi3, llama, llama_decode, lora
from models.contract import Decoder, Family, HFMapping
from models.llama import LlamaConfig
from models.rope import factors
from spmd.errors import UsageError

PhiScaling = Literal["none", "longrope"]


@dataclasses.dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    """A Phi-3: LlamaConfig's fields (sizes are counts) without q/k/v biases or q/k norms, and
    LongRoPE's; its Hugging Face form is Phi3ForCausalLM."""

    family: str = "phi3"  # the model family this config describes (models.family)
    # rotary frequency scaling: none, or longrope (Phi-3.5-mini's: per-pair divisors, short
    # ones up to --rope-original-max-positions positions, long ones beyond)
    rope_scaling: PhiScaling = "none"
    rope_short_factors: str = ""  # longrope: head_dim / 2 comma-separated divisors, short set
    rope_long_factors: str = ""  # longrope: head_dim / 2 comma-separated divisors, long set
    rope_attention_factor: float = 1.0  # longrope: cos and sin scale (q . k by its square)


def check(cfg: Phi3Config) -> None:
    """UsageError for a config no Phi-3 can be built from: the Llama's checks, then the Llama
    switches Phi3ForCausalLM has no counterpart of, each named by its flag."""
    longrope = cfg.rope_scaling == "longrope"  # the Llama's rope check knows no longrope
    llama.check(dataclasses.replace(cfg, rope_scaling="none") if longrope else cfg)
    for flag, value in (("--qkv-bias", cfg.qkv_bias), ("--qk-norm", cfg.qk_norm)):
        if value:
            raise UsageError(
                f"{flag} true: a Phi-3 has no such weights; use --family llama for a Llama "
                f"with them"
            )
    if cfg.rope_scaling not in ("none", "longrope"):
        raise UsageError(
            f"--rope-scaling {cfg.rope_scaling!r}: Phi3ForCausalLM computes no such rope "
            f"scaling; a Phi-3 takes none or longrope"
        )
    if longrope:
        check_longrope(cfg)


def check_longrope(cfg: Phi3Config) -> None:
    """UsageError for LongRoPE settings that give no frequencies."""
    for flag, text in (
        ("--rope-short-factors", cfg.rope_short_factors),
        ("--rope-long-factors", cfg.rope_long_factors),
    ):
        try:
            values = factors(text)
        except ValueError:
            values = ()
        if len(values) != cfg.head_dim // 2 or not all(0 < v < math.inf for v in values):
            raise UsageError(
                f"{flag} {text!r} must be {cfg.head_dim // 2} positive numbers (head_dim / 2), "
                f"comma-separated"
            )
    if not 0 < cfg.rope_attention_factor < math.inf:
        raise UsageError(
            f"--rope-attention-factor {cfg.rope_attention_factor} must be positive and finite"
        )
    if cfg.rope_original_max_positions < 1:
        raise UsageError(
            f"--rope-original-max-positions {cfg.rope_original_max_positions} must be a "
            f"positive number of positions"
        )


def check_layout(cfg: Phi3Config, mesh: Any, executor: str) -> None:
    """UsageError for layouts the model does not compose with: the Llama's (llama.check_layout),
    and LongRoPE with context parallelism (its set of factors
    depends on the longest position, which a device holding a part of them does not see)."""
    llama.check_layout(cfg, mesh, executor)
    if cfg.rope_scaling == "longrope" and mesh.shape["context"] > 1:
        raise UsageError(
            f"--rope-scaling longrope with cp={mesh.shape['context']}: each device would pick "
            f"short or long factors from its own part of the positions; use cp=1"
        )


def decode(
    model: llama.Llama, tokens: jax.Array, positions: jax.Array, cache: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """llama_decode.forward, refusing (UsageError, while tracing) a LongRoPE prefill of a
    prompt within rope_original_max_positions into a cache longer than that: transformers
    would recompute the cache with the long factors once the sequence passes that length,
    which a cache kept from the short ones cannot follow."""
    cfg, length = model.cfg, cache["k"].shape[2]
    prompt = tokens.shape[1]  # a prefill writes positions [0, prompt); a step writes one
    original = cfg.rope_original_max_positions
    if cfg.rope_scaling == "longrope" and 1 < prompt <= original < length:
        raise UsageError(
            f"generating past {original} positions (rope_original_max_positions) from a "
            f"{prompt}-token prompt: LongRoPE then changes every position's rotation, which "
            f"spmd's key/value cache does not recompute; generate at most {original - prompt} "
            f"tokens, or give a prompt longer than {original}"
        )
    return llama_decode.forward(model, tokens, positions, cache)


def from_hf(raw: dict[str, Any], where: str, remat: str = "none") -> Phi3Config:
    """The Phi3Config of a Phi3ForCausalLM config.json (as a dict); UsageError naming a field
    spmd does not compute."""
    cfg = Phi3Config(**hf_phi3.config_fields(raw, where, remat))
    check(cfg)
    return cfg


# Phi-3's fused projections: one adapter each (one A, the parts' B's concatenated), as peft
# adapts its qkv_proj and gate_up_proj Linears
LORA_TARGETS = {
    "qkv": lora.ATTENTION["q"] + lora.ATTENTION["k"] + lora.ATTENTION["v"],
    "o": lora.ATTENTION["o"],
    "gate_up": lora.MLP["gate"] + lora.MLP["up"],
    "down": lora.MLP["down"],
}
FAMILY = Family(
    name="phi3",
    config=Phi3Config,
    check=check,
    check_layout=check_layout,
    # models/llama_decode.py's cache, with a forward that refuses crossing LongRoPE's length
    decoder=Decoder(init_cache=llama_decode.init_cache, forward=decode),
    hf=HFMapping(
        model_types={"phi3": hf_phi3.ARCHITECTURE},
        config_from_hf=from_hf,
        config_to_hf=hf_phi3.hf_config,
        tensors=hf_phi3.TENSORS,
    ),
    lora_targets=LORA_TARGETS,
)
