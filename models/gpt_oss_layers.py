"""GPT-OSS's attention and experts (models/gpt_oss.py is the family around them), speaking
logical axis names only.

Attention (models.attention.Attention's projections, with q/k/v biases):
- attention sinks: one learned logit per query head in every row's softmax denominator, with
  no value (`sinks` [heads], split with the heads under tensor parallelism);
- a bias on the output projection, added once after the heads' row-parallel sum;
- sliding-window and full layers alternating by index: layer i is full when (i + 1) %
  global_every == 0 (GPT-OSS: 1, 3, 5, ...), else it sees a window of `sliding_window`
  positions, chosen in the layer scan by `lax.cond` between two constant windows
  (models.gemma2.static_window), as Gemma's;
- YaRN rotary frequencies and attention factor (models/rope.py).

Experts (models.moe.Experts' router and dispatch):
- the router is a linear layer with a bias: logits = x W + b, the top k of them, a softmax
  over those k (the same as the softmax over all E renormalised over the top k: the MoE
  family's norm_topk_prob);
- each expert's gate and up projections are one matrix [E, embed, 2 x mlp] with the gate and
  up columns interleaved (gate j is column 2j, up j column 2j + 1), as the checkpoints store
  it, and biases on gate_up [E, 2 x mlp] and down [E, embed]. Under tensor parallelism each
  device holds a contiguous run of the 2 x mlp columns, whole (gate, up) pairs where tp
  divides mlp (check_layout);
- the clamped SwiGLU: gate clamped to at most `swiglu_limit`, up to [-limit, limit], then
  (up + 1) x gate x sigmoid(swiglu_alpha x gate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
from flax import nnx

from models import moe
from models.attention import Attention, causal_attention
from models.gemma2 import static_window
from models.layers import RESIDUAL, WHOLE, RMSNorm, dense, weight, zeros
from models.layers import param as _param
from spmd.parallel.hooks import attention, constrain, gather, tp_enter, tp_reduce

if TYPE_CHECKING:
    from models.gpt_oss import GptOssConfig


def layer_window(cfg: GptOssConfig, layer: jax.Array | int) -> jax.Array | int:
    """The window of layer `layer` (an int32 index traced in the layer scan, or an int): 0 for
    a full layer, else sliding_window; an int wherever every layer has the same."""
    if not cfg.sliding_window or cfg.global_every == 1:
        return 0
    if not cfg.global_every:
        return cfg.sliding_window
    if isinstance(layer, int):
        return 0 if (layer + 1) % cfg.global_every == 0 else cfg.sliding_window
    full = (jnp.asarray(layer, jnp.int32) + 1) % cfg.global_every == 0
    return jnp.where(full, 0, cfg.sliding_window)


class SinkAttention(Attention):
    """Attention with sinks, an output bias and the window of its layer (module docstring)."""

    def __init__(self, cfg: GptOssConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)  # q, k, v, o and the q/k/v biases (cfg.qkv_bias)
        self.sinks = _param(rngs, 0.02, (cfg.n_heads,), ("heads",))
        self.bo = zeros((cfg.embed_dim,), ("embed",))
        self.cfg = cfg

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None = None,
        layer: jax.Array | int = 0,
    ) -> jax.Array:
        window = layer_window(self.cfg, layer)
        x = constrain(tp_enter(x, "heads"), WHOLE)  # column-parallel q, k, v: local heads
        q, k, v = self.project(x, positions)
        sinks = gather(self.sinks)  # this device's heads'

        # (Ulysses runs `local` on whole sequences of a share of the heads: it passes their
        # ids as `segments` and that share of the sinks as `sinks`)
        def local(q: jax.Array, k: jax.Array, v: jax.Array, segments: Any = segments,
                  sinks: jax.Array = sinks) -> jax.Array:  # fmt: skip
            def attend(window: int) -> jax.Array:
                return causal_attention(q, k, v, segments, window, sinks=sinks)

            return static_window(cast(Any, self.cfg), window, attend)  # (its sliding_window)

        out = attention(q, k, v, local, segments, window, sinks=sinks)
        out = dense(out, weight(self, "wo"), inputs=2)
        # row-parallel: sum the heads' partial outputs, then the bias once
        return constrain(tp_reduce(out, "heads") + gather(self.bo).astype(out.dtype), RESIDUAL)

    def cached_at(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, layer: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention over one layer's key / value cache, as Attention.cached, with layer
        `layer`'s window, the sinks and the output bias."""
        window, sinks = layer_window(self.cfg, layer), gather(self.sinks)
        out, keys, values = self.cached(x, positions, keys, values, window, sinks)
        return out + gather(self.bo).astype(out.dtype), keys, values


class BiasedExperts(moe.Experts):
    """models.moe.Experts with a biased router, interleaved gate/up, expert biases and the
    clamped SwiGLU (module docstring). The router and w_down are moe.Experts'."""

    cfg: GptOssConfig

    def __init__(self, cfg: GptOssConfig, rngs: nnx.Rngs):
        e, m, n = cfg.embed_dim, cfg.expert_dim, cfg.n_experts
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.router = _param(rngs, 0.02, (e, n), ("embed", None))
        self.router_logit_bias = nnx.Param(jnp.zeros((n,), jnp.float32), out_sharding=(None,))
        self.w_gate_up = _param(rngs, 0.02, (n, e, 2 * m), ("expert", "embed", "mlp"))
        self.b_gate_up = zeros((n, 2 * m), ("expert", "mlp"))
        self.w_down = _param(rngs, out_std, (n, m, e), ("expert", "mlp", "embed"))
        # (the embed dim whole, as the expert dim takes fsdp: spmd.estimate.shape.PARAM_AXES)
        self.b_down = nnx.Param(jnp.zeros((n, e), jnp.float32), out_sharding=("expert", None))
        self.cfg = cfg

    def router_logits(self, x: jax.Array) -> jax.Array:
        """x W + b (fp32 [b, t, E])."""
        return super().router_logits(x) + gather(self.router_logit_bias)

    def expert_weights(self) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple]:
        """The gate and up columns of gate_up apart (each device's run of them holds whole
        pairs), w_down, and the biases of each."""
        w, b = gather(self.w_gate_up), gather(self.b_gate_up)
        biases = (b[..., 0::2], b[..., 1::2], gather(self.b_down))
        return (w[..., 0::2], w[..., 1::2], gather(self.w_down)), biases

    def activation(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The clamped SwiGLU (module docstring), in the activations' dtype as transformers."""
        limit, alpha = self.cfg.swiglu_limit, self.cfg.swiglu_alpha
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class Block(nnx.Module):
    """Pre-norm attention with sinks, then the biased experts; told its layer's index."""

    def __init__(self, cfg: GptOssConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.attn = SinkAttention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.experts = BiasedExperts(cfg, rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: Any = None, layer: Any = 0
    ) -> tuple[jax.Array, dict]:
        x = x + self.attn(self.attn_norm(x), positions, segments, layer)
        y, stats = self.experts(self.mlp_norm(x))
        return constrain(x + y, RESIDUAL), stats

    def decode(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, layer: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block over one layer's key / value cache (models/llama_decode.py): dropless
        routing groups tokens per row, so each routes as in the full forward pass."""
        attended, keys, values = self.attn.cached_at(
            self.attn_norm(x), positions, keys, values, layer
        )
        x = x + attended
        y, _ = self.experts(self.mlp_norm(x))
        return constrain(x + y, RESIDUAL), keys, values
