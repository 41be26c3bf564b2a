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
  LlamaConfig.sliding_window. Context parallelism is refused with it (llama.check_layout).
- the rest of config.json (models/hf_phi3.py): rope_type default only (Phi-3.5-mini's and the
  128k models' `longrope` is refused, naming it), partial_rotary_factor 1 only, the dropout
  rates 0 only (spmd trains without dropout), the token ids left to generation_config.json.

So the family reuses llama.Llama, its loss and its cached decoder, with a config that says
"phi3" (the HF architecture it writes) and refuses the Llama switches Phi-3 has no
counterpart of (q/k/v biases, q/k norms, rope scalings other than none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from models import hf_phi3, llama, llama_decode
from models.contract import Decoder, Family, HFMapping
from models.llama import LlamaConfig
from spmd.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    """A Phi-3: LlamaConfig's fields (sizes are counts), without q/k/v biases, q/k norms or
    rope scaling, whose Hugging Face form is Phi3ForCausalLM."""

    family: str = "phi3"  # the model family this config describes (models.family)


def check(cfg: Phi3Config) -> None:
    """UsageError for a config no Phi-3 can be built from: the Llama's checks, then the Llama
    switches Phi3ForCausalLM has no counterpart of, each named by its flag."""
    llama.check(cfg)
    for flag, value in (("--qkv-bias", cfg.qkv_bias), ("--qk-norm", cfg.qk_norm)):
        if value:
            raise UsageError(
                f"{flag} true: a Phi-3 has no such weights; use --family llama for a Llama "
                f"with them"
            )
    if cfg.rope_scaling != "none":
        raise UsageError(
            f"--rope-scaling {cfg.rope_scaling!r}: Phi3ForCausalLM computes no such rope "
            f"scaling; a Phi-3 takes none"
        )


def check_layout(cfg: Phi3Config, mesh: Any, executor: str) -> None:
    """UsageError for layouts the model does not compose with: the Llama's (a sliding window
    with context parallelism)."""
    llama.check_layout(cfg, mesh, executor)


def create(cfg: Phi3Config, seed: int, dtype: Any = jnp.float32) -> llama.Llama:
    """A freshly initialised Phi-3 (llama.Llama, eager and unsharded)."""
    return llama.create(cfg, seed, dtype)


def from_hf(raw: dict[str, Any], where: str, remat: str = "none") -> Phi3Config:
    """The Phi3Config of a Phi3ForCausalLM config.json (as a dict); UsageError naming a field
    spmd does not compute."""
    cfg = Phi3Config(**hf_phi3.config_fields(raw, where, remat))
    check(cfg)
    return cfg


FAMILY = Family(
    name="phi3",
    config=Phi3Config,
    create=create,
    loss=llama.lm_loss,
    logits_loss=llama.logits_loss,
    check=check,
    check_layout=check_layout,
    # models.family.LLAMA_DECODER's functions (that module imports this one)
    decoder=Decoder(init_cache=llama_decode.init_cache, forward=llama_decode.forward),
    hf=HFMapping(
        architectures=(hf_phi3.ARCHITECTURE,),
        model_types={"phi3": hf_phi3.ARCHITECTURE},
        config_from_hf=from_hf,
        config_to_hf=hf_phi3.hf_config,
        tensors=hf_phi3.TENSORS,
    ),
)
