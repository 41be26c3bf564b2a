"""OLMo 2 (Hugging Face `Olmo2ForCausalLM`) in Flax NNX, speaking logical axis names only.

OLMo 2 is the Llama of models/llama.py (embedding, rotary attention with grouped-query heads,
SwiGLU MLP, final RMS norm, output head; untied in the releases, tied supported) with two
differences:

- post-norm blocks: no norm before attention or the MLP; each sublayer's output is RMS-normed
  before it joins the residual stream,
      h = x + post_attn_norm(attention(x));  out = h + post_mlp_norm(mlp(h));
- q and k are RMS-normed over the whole projection, before rotary: all heads' features of a
  token as one vector (heads x head_dim for q, kv_heads x head_dim for k) with one scale of
  that width (models.layers.HeadsRMSNorm through Attention's `whole_qk_norm`), not per head
  as Qwen3's `qk_norm`.

Under tensor parallelism the heads are split over `tensor`, so the mean of squares of the q
and k norms is summed over the tensor shards (the explicit executor's psum; under the auto
executor the mean over a sharded dim is already global). When tp exceeds the kv heads they are
replicated: each device projects k for all of them, norms over all of them (nothing to sum)
and keeps the ones its query heads read. The norm scales are [heads, head_dim] and [kv_heads,
head_dim] params, split with the heads.

The blocks do not differ by index, so a pipeline may split them anywhere and context
parallelism's ring sees ordinary causal attention: no layout is refused beyond the Llama's.
config.json and the tensors map as models/hf_olmo2.py says; the config is LlamaConfig's fields
(the Llama-only switches qkv_bias, qk_norm and sliding_window refused) with family "olmo2".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from models import hf_olmo2, llama
from models.attention import Attention
from models.contract import Family, HFMapping
from models.layers import RESIDUAL, RMSNorm, creator
from models.llama import LlamaConfig
from spmd.errors import UsageError
from spmd.model_shape import ModelShape
from spmd.parallel.hooks import constrain


@dataclasses.dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
    """LlamaConfig's sizes, rope and training fields for an OLMo 2 (qkv_bias, qk_norm and
    sliding_window stay off: OLMo 2 has none of them). Sizes are counts."""

    family: str = "olmo2"  # the model family this config describes (models.family)

    def shape(self) -> ModelShape:
        """The sizes the estimators read: a dense Llama's, with the q and k norms over the
        whole projections."""
        return dataclasses.replace(super().shape(), whole_qk_norm=True)


# The Llama switches OLMo 2 does not have: field -> what it would mean
LLAMA_ONLY = {
    "qkv_bias": "biases on q, k and v (Qwen2)",
    "qk_norm": "per-head q and k norms (Qwen3; OLMo 2 norms q and k over all heads always)",
    "sliding_window": "a sliding attention window (Mistral)",
}


def check(cfg: Olmo2Config) -> None:
    """UsageError for a config no OLMo 2 can be built from: the Llama's checks (sizes, heads,
    rope, remat), then the Llama-only switches, named by their flags."""
    llama.check(cfg)
    for name, what in LLAMA_ONLY.items():
        if getattr(cfg, name):
            flag = "--" + name.replace("_", "-")
            raise UsageError(
                f"{flag} {getattr(cfg, name)}: {what} is not part of OLMo 2 (family olmo2); "
                f"use family llama for it"
            )


def check_layout(cfg: Olmo2Config, mesh: Any, executor: str) -> None:
    """Nothing beyond the Llama's refusals (llama.check_layout): the blocks are alike, so every
    pipeline split runs, and the q / k norms sum over whatever splits the heads."""
    llama.check_layout(cfg, mesh, executor)


class Block(nnx.Module):
    """An OLMo 2 block: attention and MLP on the raw residual stream, each output RMS-normed
    before it is added back."""

    def __init__(self, cfg: Olmo2Config, rngs: nnx.Rngs):
        self.attn = Attention(cfg, rngs, whole_qk_norm=True)
        self.post_attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.mlp = llama.MLP(cfg, rngs)
        self.post_mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
    ) -> jax.Array:
        x = x + self.post_attn_norm(self.attn(x, positions, segments))
        x = x + self.post_mlp_norm(self.mlp(x))
        return constrain(x, RESIDUAL)

    def decode(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, layer: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block over one layer's key / value cache (models/llama_decode.py): (x, keys,
        values) with this call's keys and values written at `positions`."""
        attended, keys, values = self.attn.cached(x, positions, keys, values)
        x = x + self.post_attn_norm(attended)
        x = x + self.post_mlp_norm(self.mlp(x))
        return constrain(x, RESIDUAL), keys, values


class Olmo2(llama.Llama):
    """tokens [batch, length] -> fp32 logits [batch, length, vocab]: llama.Llama's embedding,
    stacked layers and head around OLMo 2 blocks."""

    block_type = Block


def config_from_hf(raw: dict[str, Any], where: str, remat: str = "none") -> Olmo2Config:
    """The Olmo2Config of an Olmo2ForCausalLM config.json (models/hf_olmo2.py); UsageError
    naming any field spmd does not compute."""
    cfg = Olmo2Config(**hf_olmo2.config_fields(raw, where, remat))
    check(cfg)
    return cfg


FAMILY = Family(
    name="olmo2",
    config=Olmo2Config,
    create=creator(Olmo2),
    check=check,
    check_layout=check_layout,
    hf=HFMapping(
        model_types={"olmo2": hf_olmo2.ARCHITECTURE},
        config_from_hf=config_from_hf,
        config_to_hf=hf_olmo2.olmo2_hf_config,
        tensors=hf_olmo2.TENSORS,
    ),
)
