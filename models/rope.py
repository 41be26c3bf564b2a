"""The rotary position embedding and the frequency scalings long-context checkpoints use.

Pairs (i, i + head_dim/2) of each head's features (the "rotate half" convention of Hugging
Face checkpoints) turn by angle position x inv_freq[i], with inv_freq[i] = theta^(-2i/head_dim)
(radians per position) before scaling:

    none     as is
    linear   inv_freq / factor (positions interpolated: Chen et al. 2023, "position interpolation")
    llama3   Llama 3.1's banded rule. With wavelength 2 pi / inv_freq and the context length
             L = original_max_positions it was pretrained on: wavelengths shorter than
             L / high_freq_factor are kept, those longer than L / low_freq_factor are divided by
             `factor`, and those between are blended: (1 - s) inv_freq / factor + s inv_freq
             with s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    longrope LongRoPE (Phi-3.5-mini, Phi-3's 128k models): inv_freq[i] / short_factors[i] while
             the call's longest position + 1 is at most L = original_max_positions, else
             inv_freq[i] / long_factors[i] (the pick is per call, as transformers picks per
             forward pass); cos and sin are multiplied by attention_factor either way.
    yarn     YaRN (Peng et al. 2023; GPT-OSS, DeepSeek-V3). Over L = original_max_positions
             pair i turns L x inv_freq[i] / 2 pi times; the pair index that turns r times is
             d(r) = head_dim x ln(L / (2 pi r)) / (2 ln theta). Pairs below d(beta_fast) (more
             than beta_fast turns) keep inv_freq, pairs above d(beta_slow) take inv_freq /
             factor, and between the two blend along a linear ramp in i (its ends floored and
             ceiled where `truncate`, then clipped to the pairs, as transformers does); cos
             and sin are multiplied by attention_factor (0: YaRN's 0.1 ln(factor) + 1).

Transformers' `dynamic` scaling (NTK, whose theta grows with the longest sequence seen) is
not here: its frequencies depend on the batch, so training and decoding would not match it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

import jax
import jax.numpy as jnp

from spmd.parallel.hooks import tp_max

if TYPE_CHECKING:
    from models.llama import LlamaConfig

Scaling = Literal["none", "linear", "llama3"]
SCALINGS = ("none", "linear", "llama3")  # LlamaConfig's; "longrope" is the phi3 family's


@dataclasses.dataclass(frozen=True)
class Rope:
    """A rotary embedding's settings (LlamaConfig's rope_* fields)."""

    theta: float = 10000.0  # base of the frequencies
    scaling: str = "none"  # Scaling, or "longrope"
    factor: float = 1.0  # linear, llama3: how much longer the context is than pretraining's
    low_freq_factor: float = 1.0  # llama3: wavelengths over L / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths under L / this are kept
    original_max_positions: int = 8192  # llama3, longrope: L, the pretraining context (tokens)
    short_factors: tuple[float, ...] = ()  # longrope: inv_freq divisors up to L positions
    long_factors: tuple[float, ...] = ()  # longrope: inv_freq divisors beyond L positions
    attention_factor: float = 1.0  # longrope, yarn: scales cos and sin (q . k by its square)
    beta_fast: float = 32.0  # yarn: pairs turning more often than this over L are kept
    beta_slow: float = 1.0  # yarn: pairs turning less often than this over L are interpolated
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole pairs
    # the share of each head's features that rotate, the first ones (GLM-4.5: 0.5); the
    # rest pass through unrotated
    rotary_fraction: float = 1.0

    @classmethod
    def of(cls, cfg: LlamaConfig) -> Rope:
        """The rotary settings of a LlamaConfig (or anything with its rope_* fields)."""
        return cls(
            theta=cfg.rope_theta,
            scaling=cfg.rope_scaling,
            factor=cfg.rope_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_positions=cfg.rope_original_max_positions,
            short_factors=factors(getattr(cfg, "rope_short_factors", "")),
            long_factors=factors(getattr(cfg, "rope_long_factors", "")),
            attention_factor=getattr(cfg, "rope_attention_factor", 1.0),
            beta_fast=getattr(cfg, "rope_beta_fast", 32.0),
            beta_slow=getattr(cfg, "rope_beta_slow", 1.0),
            truncate=getattr(cfg, "rope_truncate", True),
            rotary_fraction=getattr(cfg, "partial_rotary_factor", 1.0),
        )

    def inv_freq(self, head_dim: int) -> jax.Array:
        """fp32 [head_dim / 2]: radians per position of each rotated pair (longrope: before its
        factors, which depend on the positions: `__call__`)."""
        half = head_dim // 2
        freqs = self.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
        if self.scaling == "linear":
            return freqs / self.factor
        if self.scaling == "llama3":
            return self._llama3(freqs)
        if self.scaling == "yarn":
            return self._yarn(freqs, head_dim)
        return freqs

    def _llama3(self, freqs: jax.Array) -> jax.Array:
        context = self.original_max_positions
        wavelength = 2 * math.pi / freqs
        blend = (context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - blend) * freqs / self.factor + blend * freqs
        scaled = jnp.where(wavelength > context / self.low_freq_factor, freqs / self.factor, freqs)
        kept = wavelength < context / self.high_freq_factor
        between = ~kept & ~(wavelength > context / self.low_freq_factor)
        return jnp.where(between, blended, scaled)

    def _yarn(self, freqs: jax.Array, head_dim: int) -> jax.Array:
        def pair_turning(turns: float) -> float:  # d(r) of the module docstring
            context = self.original_max_positions
            return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = pair_turning(self.beta_fast), pair_turning(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:  # transformers' guard against a ramp of no width
            high += 0.001
        ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        return freqs / self.factor * ramp + freqs * (1 - ramp)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [batch, length, heads, head_dim] rotated at `positions` [batch, length] (its first
        rotary_fraction x head_dim features; the frequencies those features' own, as
        transformers' partial rotary computes them)."""
        rotated = rotary_dims(x.shape[-1], self.rotary_fraction)
        if rotated < x.shape[-1]:
            whole = dataclasses.replace(self, rotary_fraction=1.0)
            return jnp.concatenate([whole(x[..., :rotated], positions), x[..., rotated:]], -1)
        inv_freq = self.inv_freq(x.shape[-1])
        if self.scaling == "longrope":
            # over every row of the forward pass, as transformers' max(position_ids): the
            # explicit executor's data-parallel shards agree on the pick
            longer = tp_max(jnp.max(positions), "batch") + 1 > self.original_max_positions
            inv_freq = inv_freq / jnp.where(
                longer, jnp.asarray(self.long_factors), jnp.asarray(self.short_factors)
            ).astype(jnp.float32)
        return rotate(x, positions, inv_freq, self.attention_factor)


def rotate(
    x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0
) -> jax.Array:
    """x [batch, length, heads, head_dim] rotated at `positions` [batch, length] by the fp32
    frequencies `inv_freq` [head_dim / 2] (radians per position; traced where a layer picks
    among several rotary bases), with cos and sin times `scale` (LongRoPE's attention factor;
    1 otherwise)."""
    half = x.shape[-1] // 2
    angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def rotary_dims(head_dim: int, fraction: float) -> int:
    """The features of a head that rotate: int(head_dim x fraction), as transformers rounds."""
    return int(head_dim * fraction)


def factors(text: str) -> tuple[float, ...]:
    """A config's comma-separated list of numbers ("1.0,1.25") as floats; () for ""."""
    return tuple(float(part) for part in text.split(",")) if text.strip() else ()
