"""A Hugging Face checkpoint's tensors as a table of rules, and the entries a model's params
expand it to: which HF tensor holds which spmd param (or which layer's or expert's row of a
stacked one), its shape and how it is stored. models/hf_io.py streams the entries in and out;
each family states its own table in its HF mapping (models/hf_config.py for the Llama family,
models/hf_mixtral.py for Mixtral's experts, ...).

A rule is (spmd param path, HF name, in_dims). "{}" in the name is the layer index (then the
expert, for a [layers, experts, ...] param). HF stores a Linear as [out, in]; in_dims is how
many leading dims of the spmd param make up `in` (0: stored as is, FLAT: stored as one dim).
Several rules with the same HF name are one fused tensor (Phi-3's qkv_proj, gate_up_proj):
their parts are concatenated along HF's first (output) dim in the table's order, split on
import and fused again on export.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from models import layer_groups
from spmd.model_shape import STACKS

if TYPE_CHECKING:
    from models.contract import ModelConfig

FLAT = -1  # in_dims of a tensor HF stores flattened: a bias [heads * head_dim]

Rule = tuple[tuple[str, ...], str, int]  # (spmd param path, HF name, in_dims)
# params under these keys carry a leading `layers` dim: the blocks, and an MoE's dense-MLP
# layers (models/layer_groups.py)
STACKED, DENSE_STACK = STACKS


@dataclasses.dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor (or one part of a fused one) and where it goes in the spmd
    params."""

    hf_name: str
    path: tuple[str, ...]
    layer: tuple[int, ...] | None  # (layer,) or (layer, expert) in a stacked param, or None
    shape: tuple[int, ...]  # the spmd shape of this tensor (one layer's / expert's if stacked)
    in_dims: int
    offset: int = 0  # a fused tensor's part: its first row in HF's first dim
    fused_rows: int = 0  # a fused tensor's part: the rows of the whole HF tensor (0: unfused)

    @property
    def part_shape(self) -> tuple[int, ...]:
        """The shape of this param as HF stores it (its rows only, in a fused tensor)."""
        if self.in_dims == FLAT:
            return (math.prod(self.shape),)
        if not self.in_dims:
            return self.shape
        return (math.prod(self.shape[self.in_dims :]), math.prod(self.shape[: self.in_dims]))

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of the whole HF tensor (every part of a fused one)."""
        part = self.part_shape
        return (self.fused_rows, *part[1:]) if self.fused_rows else part

    @property
    def transposed(self) -> bool:
        """Whether HF stores this tensor transposed ([out, in] of a Linear)."""
        return self.in_dims > 0

    def to_spmd(self, hf: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """This entry's rows of the HF tensor in spmd layout and `dtype` (one host copy)."""
        if self.fused_rows:
            hf = hf[self.offset : self.offset + self.part_shape[0]]
        host = hf.T if self.transposed else hf
        return np.ascontiguousarray(host, dtype=dtype).reshape(self.shape)

    def to_hf(self, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """The spmd value as HF stores it (this part's rows only, in a fused tensor)."""
        part = self.part_shape
        host = value.reshape(part[::-1]).T if self.transposed else value
        return np.ascontiguousarray(host, dtype=dtype).reshape(part)


def param_shapes(create: Callable[..., nnx.Module], cfg: ModelConfig) -> dict[str, Any]:
    """The spmd params of the model `create(cfg, seed)` builds, as a pure dict of
    ShapeDtypeStructs (nothing allocated)."""
    with nnx.use_eager_sharding(False):
        return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: create(cfg, 0))))


def entries(
    params: dict[str, Any], table: tuple[Rule, ...], dense: tuple[int, ...] = ()
) -> list[Entry]:
    """Every HF tensor part of a model whose params (arrays or ShapeDtypeStructs) are
    `params`, by the rules of `table`, in the order Hugging Face lists them: embeddings, layer
    by layer, final norm, head. Rules whose param the model lacks (a tied head, biases it has
    not) give none. A model with a second stack (an MoE's dense-MLP layers, `dense` their
    indices: models/layer_groups.py) takes each stacked rule for it too, each row numbered by
    its model layer."""
    top, per_layer = [], []
    stacks = [STACKED, DENSE_STACK] if DENSE_STACK in params else [STACKED]
    for rule_path, hf_name, in_dims in table:
        for stack in stacks if rule_path[0] == STACKED else [None]:
            path = rule_path if stack is None else (stack, *rule_path[1:])
            if not has(params, path):
                continue
            shape = tuple(get(params, path).shape)
            if stack is None:
                top.append(Entry(hf_name, path, None, shape, in_dims))
            else:
                per_layer.append((path, hf_name, in_dims, shape))
    total = sum(_rows(params, stack) for stack in stacks)
    numbers = {s: layer_groups.stack_layers(dense, total, s == DENSE_STACK) for s in stacks}
    layers = []
    for path, hf_name, in_dims, shape in per_layer:
        for row, i in enumerate(numbers[path[0]]):
            if hf_name.count("{}") == 1:
                layers.append(Entry(hf_name.format(i), path, (row,), shape[1:], in_dims))
            else:  # one HF tensor per expert: rows [row, j] of a [layers, experts, ...] param
                layers += [
                    Entry(hf_name.format(i, j), path, (row, j), shape[2:], in_dims)
                    for j in range(shape[1])
                ]
    # layer by layer as Hugging Face lists them (a stable sort keeps the table's order within)
    layer_of = {id(e): numbers[e.path[0]][e.layer[0]] for e in layers if e.layer}
    layers.sort(key=lambda e: layer_of[id(e)])
    return _fuse(top[:1] + layers + top[1:])


def _rows(params: dict[str, Any], stack: str) -> int:
    """The stacked layers of `params[stack]` (the leading dim of its params)."""
    return next(iter(jax.tree.leaves(params[stack]))).shape[0]


def _fuse(found: list[Entry]) -> list[Entry]:
    """The entries with each part of a fused HF tensor (several entries of one name) given its
    rows: the parts stacked along the first dim in table order."""
    parts: dict[str, list[Entry]] = {}
    for entry in found:
        parts.setdefault(entry.hf_name, []).append(entry)
    out = []
    for entry in found:
        group = parts[entry.hf_name]
        if len(group) == 1:
            out.append(entry)
            continue
        offset = sum(e.part_shape[0] for e in group[: group.index(entry)])
        rows = sum(e.part_shape[0] for e in group)
        out.append(dataclasses.replace(entry, offset=offset, fused_rows=rows))
    return out


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
