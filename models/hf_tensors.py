"""The table of a Hugging Face Llama-family checkpoint's tensors and the spmd params they are
(Mixtral's expert tensors are added from models/hf_mixtral.py): names, shapes and how each is
stored. models/hf_llama.py streams them in and out.

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

import dataclasses
import math
from typing import Any

import numpy as np
from flax import nnx

from models import hf_mixtral, llama, moe

FLAT = -1  # in_dims of a tensor HF stores flattened: a bias [heads * head_dim]

# (spmd param path, Hugging Face name ("{}" = layer index), in_dims): HF stores a Linear as
# [out, in]; in_dims is how many leading dims of the spmd param make up `in` (0: stored as is,
# FLAT: stored as one dim).
TENSORS: tuple[tuple[tuple[str, ...], str, int], ...] = (
    (("embed",), "model.embed_tokens.weight", 0),
    (("blocks", "attn", "wq"), "model.layers.{}.self_attn.q_proj.weight", 1),
    (("blocks", "attn", "wk"), "model.layers.{}.self_attn.k_proj.weight", 1),
    (("blocks", "attn", "wv"), "model.layers.{}.self_attn.v_proj.weight", 1),
    (("blocks", "attn", "wo"), "model.layers.{}.self_attn.o_proj.weight", 2),
    (("blocks", "attn", "bq"), "model.layers.{}.self_attn.q_proj.bias", FLAT),
    (("blocks", "attn", "bk"), "model.layers.{}.self_attn.k_proj.bias", FLAT),
    (("blocks", "attn", "bv"), "model.layers.{}.self_attn.v_proj.bias", FLAT),
    (("blocks", "attn", "q_norm", "scale"), "model.layers.{}.self_attn.q_norm.weight", 0),
    (("blocks", "attn", "k_norm", "scale"), "model.layers.{}.self_attn.k_norm.weight", 0),
    (("blocks", "mlp", "w_gate"), "model.layers.{}.mlp.gate_proj.weight", 1),
    (("blocks", "mlp", "w_up"), "model.layers.{}.mlp.up_proj.weight", 1),
    (("blocks", "mlp", "w_down"), "model.layers.{}.mlp.down_proj.weight", 1),
    (("blocks", "attn_norm", "scale"), "model.layers.{}.input_layernorm.weight", 0),
    (("blocks", "mlp_norm", "scale"), "model.layers.{}.post_attention_layernorm.weight", 0),
    (("final_norm", "scale"), "model.norm.weight", 0),
    (("lm_head",), "lm_head.weight", 1),
    *hf_mixtral.TENSORS,  # a model has either the dense MLP's tensors or the experts'
)
STACKED = "blocks"  # params under this key carry a leading `layers` dim


@dataclasses.dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor and where it goes in the spmd params."""

    hf_name: str
    path: tuple[str, ...]
    layer: tuple[int, ...] | None  # (layer,) or (layer, expert) in a stacked param, or None
    shape: tuple[int, ...]  # the spmd shape of this tensor (one layer's / expert's if stacked)
    in_dims: int

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.in_dims == FLAT:
            return (math.prod(self.shape),)
        if not self.in_dims:
            return self.shape
        return (math.prod(self.shape[self.in_dims :]), math.prod(self.shape[: self.in_dims]))

    @property
    def transposed(self) -> bool:
        """Whether HF stores this tensor transposed ([out, in] of a Linear)."""
        return self.in_dims > 0

    def to_spmd(self, hf: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """The HF tensor in spmd layout and `dtype` (one host copy)."""
        host = hf.T if self.transposed else hf
        return np.ascontiguousarray(host, dtype=dtype).reshape(self.shape)

    def to_hf(self, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
        host = value.reshape(self.hf_shape[::-1]).T if self.transposed else value
        return np.ascontiguousarray(host, dtype=dtype).reshape(self.hf_shape)


def param_shapes(cfg: llama.LlamaConfig) -> dict[str, Any]:
    """The spmd params of `cfg` (dense or MoE) as a pure dict of ShapeDtypeStructs."""
    with nnx.use_eager_sharding(False):
        return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: moe.create(cfg, 0))))


def entries(params: dict[str, Any]) -> list[Entry]:
    """Every HF tensor of a model whose params (arrays or ShapeDtypeStructs) are `params`, in
    the order Hugging Face lists them: embeddings, layer by layer, final norm, head."""
    top, per_layer = [], []
    for path, hf_name, in_dims in TENSORS:
        if not has(params, path):
            continue  # lm_head with tied embeddings
        shape = tuple(get(params, path).shape)
        if path[0] == STACKED:
            per_layer.append((path, hf_name, in_dims, shape))
        else:
            top.append(Entry(hf_name, path, None, shape, in_dims))
    n_layers = per_layer[0][3][0] if per_layer else 0
    layers = []
    for i in range(n_layers):
        for path, hf_name, in_dims, shape in per_layer:
            if hf_name.count("{}") == 1:
                layers.append(Entry(hf_name.format(i), path, (i,), shape[1:], in_dims))
            else:  # one HF tensor per expert: rows [i, j] of a [layers, experts, ...] param
                layers += [
                    Entry(hf_name.format(i, j), path, (i, j), shape[2:], in_dims)
                    for j in range(shape[1])
                ]
    return top[:1] + layers + top[1:]


def has(tree: dict, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
