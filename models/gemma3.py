"""Gemma 3's text model (Hugging Face `Gemma3ForCausalLM`, model_type gemma3_text): Gemma 2
(models/gemma2.py, whose model, attention kernels and HF tensor table it reuses) with these
switches, each a field of Gemma3Config:

- per-head q and k RMS norms of the (1 + w) form before rotary (qk_norm, always on);
- five local layers to one global (global_every 6 in releases; layer_types in config.json);
- two rotary bases: rope_local_theta (10000) on the local layers, rope_theta (1e6) on the
  global ones, which alone take a linear rope scaling (rope_scaling, rope_factor: the 4B and
  larger checkpoints);
- no soft-capping: attn_softcap 0 (transformers does not apply one; a config.json that sets
  attn_logit_softcapping exits 2), final_softcap 0 unless final_logit_softcapping is set.

Each layer's window reaches the attention kernel as a constant of the program
(gemma2.static_window), and with no soft-cap both kinds of layer are plain causal attention
to models/attention.py: on a GPU in bf16 the local layers (jax.nn.dot_product_attention's
local_window_size) and the global ones reach cuDNN's fused kernel where it takes the head
dim; elsewhere "blockwise" or "xla" (docs/strategies/long-sequences.md's kernel table).

The vision tower of Gemma3ForConditionalGeneration (a config.json with vision_config) is not
supported: that architecture is not one spmd reads, and a text config carrying vision_config
exits 2 naming it. Pipelines and context parallelism are refused as for Gemma 2
(gemma2.check_layout: every pipeline stage a multiple of global_every layers; no cp).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models import gemma2, hf_gemma2
from models.contract import Family, HFMapping


@dataclasses.dataclass(frozen=True)
class Gemma3Config(gemma2.Gemma2Config):
    """Gemma2Config with Gemma 3's defaults (q/k norms, 5:1 local:global, two rotary bases,
    no soft-capping). Sizes are counts."""

    rope_theta: float = 1_000_000.0  # rotary base of the global layers
    rope_local_theta: float = 10_000.0  # rotary base of the local (sliding-window) layers
    attn_softcap: float = 0.0  # attention soft-cap (0: none, as every Gemma 3)
    final_softcap: float = 0.0  # output logits soft-capped to (-this, this) (0: none)
    global_every: int = 6  # layer i is global when (i + 1) % this == 0 (0: no global layer)
    qk_norm: bool = True  # (1 + w) RMS norm of each q and k head before rotary
    family: str = "gemma3"  # the model family this config describes (models.family)


def config_from_hf(raw: dict[str, Any], where: str, remat: str = "none") -> Gemma3Config:
    """The Gemma3Config of a Gemma3ForCausalLM config.json (models/hf_gemma2.py)."""
    cfg = Gemma3Config(**hf_gemma2.fields(raw, where, remat, hf_gemma2.GEMMA3))
    gemma2.check(cfg)
    return cfg


FAMILY = Family(
    name="gemma3",
    config=Gemma3Config,
    create=gemma2.create,
    check=gemma2.check,
    check_layout=gemma2.check_layout,
    hf=HFMapping(
        model_types={"gemma3_text": hf_gemma2.GEMMA3},
        config_from_hf=config_from_hf,
        config_to_hf=hf_gemma2.config_to_hf,
        tensors=hf_gemma2.TENSORS,
    ),
)
