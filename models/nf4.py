"""QLoRA's frozen base: block matrices stored as 4-bit NormalFloat (NF4, Dettmers et al. 2023,
bitsandbytes' `quant_type="nf4"`), dequantized to the compute dtype inside each matmul.

The format is bitsandbytes' blockwise rule: a block of 64 consecutive values is scaled by its
absmax (fp32) to [-1, 1], each value becomes the index (0..15) of the nearest of the 16 NF4
values (`CODE`), and two indices share a byte, the first in the high nibble. A value is
CODE[index] * absmax again. 0.5 B per value plus 4 B per 64 values: 0.5625 B/param, 0.28x
bf16's 2 B. No double quantization: the scales are 1/9 of the bytes.

A stacked weight w [layers, *dims] is quantized along its `embed` dim (every block matrix of
a Llama-shaped layer has exactly one): blocks run along embed, which tensor parallelism never
splits, so each device's codes and its scales cover the same values under every layout. The
codes are w's shape with embed halved and carry w's logical names (ZeRO-3 stores them split
over fsdp and gathers the 4-bit blocks inside the layer scan, as it gathers a bf16 weight);
the scales are w's shape with embed / 64 and embed's name dropped (replicated along it: 1/16
B/param). The scales are kept as the bits of their fp32 values (uint32) because the engine
casts every floating param to the working dtype (spmd.engine.precision.cast), and an absmax
in bf16 would move every value of its block.

`quantize_base` replaces a model's weights in place: the weight's attribute holds the codes,
and a `Quantized` at `<weight>_nf4` its scales; models.layers.weight dequantizes a layer's
slice (per layer, inside the scan: the whole model's weights are never dequantized at once)
before the matmul. `dequantized` gives the plain model back (export: --to-hf).

The same machinery stores --lora-base-dtype int8 (models/int8.py: int8 codes, one fp32 step
per 64 values along embed): `FORMATS` is keyed by the flag's value, each entry its block
functions, its codes' packing along embed and the suffix of its scales' site (`<weight>_nf4`,
`<weight>_int8`), and everything else here (the sites, the shardings, the dequantizing inside
each matmul, an --init-from-hf base's quantizing, the export's dequantizing) is shared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import int8
from spmd.errors import UsageError
from spmd.parallel.hooks import gather

# bitsandbytes' NF4 values (functional.get_4bit_type("nf4")): the quantiles of N(0, 1)
# normalised to [-1, 1], with an exact 0.
CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
BLOCK = 64  # values per absmax scale, bitsandbytes' QLoRA default
SUFFIX = "_nf4"  # a quantized weight's scales: the weight's name + SUFFIX
AXIS = "embed"  # the logical dim the blocks run along
TINY = 1e-12  # absmax floor: an all-zero block dequantizes to zeros, not NaN


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(codes, absmax) of x [..., n] (n a multiple of BLOCK) by bitsandbytes' rule along the
    last dim: codes [..., n / 2] uint8 (two 4-bit indices per byte, the first in the high
    nibble), absmax [..., n / BLOCK] fp32."""
    *lead, n = x.shape
    if n % BLOCK:
        raise ValueError(f"NF4 blocks of {BLOCK}: a last dim of {n} does not split into them")
    blocks = x.astype(jnp.float32).reshape(*lead, n // BLOCK, BLOCK)
    absmax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), TINY)
    code = jnp.asarray(CODE, jnp.float32)
    # nearest value; a tie goes to the lower index, as bitsandbytes' decision tree (x > mid)
    index = jnp.argmin(jnp.abs(blocks[..., None] / absmax[..., None] - code), axis=-1)
    index = index.astype(jnp.uint8).reshape(*lead, n // 2, 2)
    return (index[..., 0] << 4) | index[..., 1], absmax[..., 0]


def dequantize_blocks(codes: jax.Array, absmax: jax.Array, dtype: Any) -> jax.Array:
    """`quantize_blocks`' inverse, CODE[index] * absmax: x [..., 2 * codes' last dim] in
    `dtype`."""
    *lead, half = codes.shape
    index = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*lead, half * 2)
    values = jnp.asarray(CODE, jnp.float32)[index.astype(jnp.int32)]
    scales = jnp.repeat(absmax.astype(jnp.float32), BLOCK, axis=-1)
    return (values * scales).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Format:
    """One --lora-base-dtype value's storage: its block functions (values [..., n] ->
    (codes, fp32 scales [..., n / BLOCK]) and back), how many values one code element holds
    along the blocks' dim, and the suffix naming its scales' site."""

    quantize_blocks: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
    dequantize_blocks: Callable[[jax.Array, jax.Array, Any], jax.Array]
    packing: int
    suffix: str


FORMATS = {
    "nf4": Format(quantize_blocks, dequantize_blocks, 2, SUFFIX),
    "int8": Format(int8.quantize_blocks, int8.dequantize_blocks, 1, "_int8"),
}
assert int8.BLOCK == BLOCK  # one block rule, one embed-divisibility check (spmd.run.checks)
BASE_DTYPES = ("", *FORMATS)  # --lora-base-dtype: "" the working dtype, or a FORMATS key
SUFFIXES = tuple(f.suffix for f in FORMATS.values())
SCALE_BYTES = 4 / BLOCK  # one fp32 scale per block, either format


def quantize(w: jax.Array, axis: int, kind: str = "nf4") -> tuple[jax.Array, jax.Array]:
    """(codes, scale bits) of w with its blocks along dim `axis` in format `kind`: codes of
    w's shape with that dim divided by the packing (nf4: uint8, halved; int8: int8, whole),
    scales uint32 (fp32 bits) with it divided by BLOCK."""
    codes, absmax = FORMATS[kind].quantize_blocks(jnp.moveaxis(w, axis, -1))
    bits = jax.lax.bitcast_convert_type(absmax, jnp.uint32)
    return jnp.moveaxis(codes, -1, axis), jnp.moveaxis(bits, -1, axis)


def dequantize(
    codes: jax.Array, bits: jax.Array, axis: int, dtype: Any, kind: str = "nf4"
) -> jax.Array:
    """`quantize`'s inverse: the weight in `dtype`."""
    absmax = jax.lax.bitcast_convert_type(jnp.moveaxis(bits, axis, -1), jnp.float32)
    values = FORMATS[kind].dequantize_blocks(jnp.moveaxis(codes, axis, -1), absmax, dtype)
    return jnp.moveaxis(values, -1, axis)


def site_of(module: Any, name: str) -> Quantized | None:
    """The scales' site of weight `name` of `module` where a quantized base holds it as codes
    (of any format), else None."""
    for suffix in SUFFIXES:
        site = getattr(module, name + suffix, None)
        if site is not None:
            return site
    return None


def kind_in(key: str, tree: dict) -> str | None:
    """The format whose scales sit beside `key` in a base's pure dict `tree`, else None."""
    for kind, fmt in FORMATS.items():
        if key + fmt.suffix in tree:
            return kind
    return None


def _names(variable: nnx.Variable) -> tuple[str | None, ...]:
    return tuple(variable.get_metadata().get("out_sharding") or (None,) * variable[...].ndim)


class Quantized(nnx.Module):
    """A quantized weight's scales (an nnx.Param of uint32 fp32 bits, not trained: it lives in
    the frozen base), the dim its blocks run along, counted from the end (so that it holds for
    a layer's slice as for the stack), the dtype it dequantizes to and its format (`kind`)."""

    def __init__(
        self,
        bits: jax.Array,
        names: tuple[str | None, ...],
        from_end: int,
        dtype: Any,
        kind: str = "nf4",
    ):
        self.scales = nnx.Param(bits, out_sharding=names)
        self.from_end, self.dtype, self.kind = from_end, dtype, kind

    def dequantize(self, codes: jax.Array) -> jax.Array:
        """The weight of `codes` (gathered, this layer's or the stack's) in the compute dtype."""
        axis = codes.ndim - self.from_end
        return dequantize(codes, gather(self.scales), axis, self.dtype, self.kind)


def quantize_base(
    model: nnx.Module, paths: list[tuple[str, ...]], dtype: Any, kind: str = "nf4"
) -> None:
    """Quantize the weights at `paths` (attribute paths from `model`) in place to format
    `kind`: each holds its codes after, its scales at `<weight>` + the format's suffix;
    `dtype` is the compute dtype they dequantize to. UsageError for a weight without an embed
    dim that BLOCK divides."""
    for path in paths:
        module = _parent(model, path)
        param = getattr(module, path[-1])
        names, value = _names(param), param[...]
        if AXIS not in names or value.shape[names.index(AXIS)] % BLOCK:
            raise UsageError(
                f"--lora-base-dtype {kind} quantizes along embed in blocks of {BLOCK}: "
                f"{'/'.join(path)} {tuple(value.shape)} {names} has no such dim; use an "
                f"embed_dim that is a multiple of {BLOCK}, or leave the base unquantized"
            )
        axis = names.index(AXIS)
        codes, bits = quantize(value, axis, kind)
        scale_names = tuple(None if n == AXIS else n for n in names)
        setattr(module, path[-1], nnx.Param(codes, out_sharding=names))
        site = Quantized(bits, scale_names, value.ndim - axis, dtype, kind)
        setattr(module, path[-1] + FORMATS[kind].suffix, site)


def dequantized(model: nnx.Module, paths: list[tuple[str, ...]]) -> nnx.Module:
    """A copy of `model` (quantized at `paths` by `quantize_base`) holding plain weights of
    the dequantized values again: the base model's graph, e.g. to merge adapters into."""
    graphdef, state = nnx.split(model)
    plain = nnx.merge(graphdef, state)
    with nnx.use_eager_sharding(False):  # the names only: the arrays keep their shardings
        for path in paths:
            _restore(plain, path)
    return plain


def _restore(plain: nnx.Module, path: tuple[str, ...]) -> None:
    """The weight at `path` of `plain` dequantized in place, its scales' site removed."""
    module = _parent(plain, path)
    codes = getattr(module, path[-1])
    site = site_of(module, path[-1])
    assert site is not None, path
    weight = site.dequantize(codes[...])
    setattr(module, path[-1], nnx.Param(weight, out_sharding=_names(codes)))
    delattr(module, path[-1] + FORMATS[site.kind].suffix)


def _parent(model: nnx.Module, path: tuple[str, ...]) -> Any:
    """The module holding the attribute at `path` (attribute names from `model`)."""
    for key in path[:-1]:
        model = getattr(model, key)
    return model


# --- a base read from a Hugging Face folder: loaded whole, then quantized -----------------------


def unquantized(abstract: dict, names: dict, dtype: Any) -> dict:
    """The pure dict of ShapeDtypeStructs a base had before `quantize_base`, from the quantized
    base's `abstract` (its codes' shardings, which fit the weights' shapes too: the same
    logical names) and logical `names`: what a Hugging Face folder's weights load onto, as
    `dtype`. `abstract` itself where nothing is quantized."""
    out: dict = {}
    for key, value in abstract.items():
        if key.endswith(SUFFIXES):
            continue
        kind = kind_in(key, abstract)
        if isinstance(value, dict):
            out[key] = unquantized(value, names[key], dtype)
        elif kind is not None:
            axis, packing = tuple(names[key]).index(AXIS), FORMATS[kind].packing
            shape = tuple(n * packing if d == axis else n for d, n in enumerate(value.shape))
            out[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=value.sharding)
        else:
            out[key] = value
    return out


def quantized_like(plain: dict, names: dict, abstract: dict) -> dict:
    """`plain` (a base's pure dict of arrays, shaped as `unquantized` says) with every weight
    that `abstract` holds as codes quantized: the pure dict `quantize_base` would give."""
    out: dict = {}
    for key, value in abstract.items():
        if key.endswith(SUFFIXES):
            continue
        kind = kind_in(key, abstract)
        if isinstance(value, dict):
            out[key] = quantized_like(plain[key], names[key], value)
        elif kind is not None:
            codes, bits = quantize(plain[key], tuple(names[key]).index(AXIS), kind)
            out[key], out[key + FORMATS[kind].suffix] = codes, {"scales": bits}
        else:
            out[key] = plain[key]
    return out
