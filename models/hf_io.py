"""Hugging Face checkpoint folders <-> spmd params, streamed tensor by tensor, for any family
(models/family.py picks the family from config.json and hands its config and tensor table).

A Hugging Face checkpoint folder holds `config.json` and the weights in `model.safetensors`, or
in shards listed by `model.safetensors.index.json`. The two layouts differ only in names and in
how matrices are stored (each family's table of rules, models/hf_tensors.py); the maths is the
same, including the rotary embedding: both use the "rotate half" pairing (i, i + head_dim/2),
so q and k need no permutation.

Memory: loading reads one HF tensor at a time from a memory map, transforms it on the host and
puts it straight onto the devices in the target sharding (`jax.make_array_from_callback`: each
device gets only its slice). The spmd blocks are stacked on a leading `layers` dim, so a stacked
param gathers L HF tensors: it is first allocated as zeros on the devices in its final sharding,
then each layer is made into a one-layer device array and written into its row by a jitted,
donating `dynamic_update_index_in_dim`. The host thus holds one layer's tensor (plus the pages of
the memory map it reads), never a stacked param or the model. Export walks the other way: one
layer is sliced on the devices, fetched, transposed and written to the file, then dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from models import layer_groups, mxfp4
from models.hf_tensors import Entry, Rule, entries, get, param_shapes, put
from spmd.errors import UsageError
from spmd.io import safetensors_io

if TYPE_CHECKING:
    from models.contract import ModelConfig

EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints saved; recomputed

# --- reading a folder -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
    """A checked Hugging Face folder: its model config, where each tensor is stored and the
    tensor table of the family that reads it."""

    path: Path
    config: Any  # the family's model config
    tensors: dict[str, safetensors_io.TensorInfo]
    raw_config: dict[str, Any]
    family: str  # the models.family name that reads it
    table: tuple[Rule, ...]


def read_config(directory: str) -> dict[str, Any]:
    """config.json of folder `directory` as a dict; UsageError when it is not a Hugging Face
    folder."""
    folder = Path(directory)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise UsageError(f"{directory} is not a folder; give a Hugging Face checkpoint folder")
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{directory} has no config.json; is it a Hugging Face folder?") from None
    except OSError as e:
        raise UsageError(f"{config_path}: cannot read it ({e.strerror})") from None
    except ValueError as e:  # UnicodeDecodeError (a binary file) is a ValueError too
        raise UsageError(f"{config_path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise UsageError(
            f"{config_path} holds a JSON {type(raw).__name__}, not an object; is it a Hugging "
            f"Face config.json?"
        )
    return raw


def open_checkpoint(
    directory: str,
    raw: dict[str, Any],
    cfg: ModelConfig,
    family: str,
    create: Callable[..., Any],
    table: tuple[Rule, ...],
) -> HFCheckpoint:
    """Read the safetensors headers of `directory` (no tensor data) and check that every
    tensor the model `create(cfg)` has by `table` is there with its shape; UsageError naming
    the first missing, misshapen or unexpected tensor."""
    folder = Path(directory)
    tensors = _read_tensors(folder)
    found = entries(param_shapes(create, cfg), table, layer_groups.dense_of(cfg))
    _check_tensors(tensors, found, cfg, folder, raw)
    if skipped := skipped_prediction_tensors(tensors, raw):
        print(f"{folder}: {skipped}", file=sys.stderr)
    return HFCheckpoint(folder, cfg, tensors, raw, family, table)


def _read_tensors(folder: Path) -> dict[str, safetensors_io.TensorInfo]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise UsageError(f"{index} is not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{folder} holds no *.safetensors files (nor {INDEX_FILE})")
    tensors: dict[str, safetensors_io.TensorInfo] = {}
    for name in files:
        if not (folder / name).is_file():
            raise UsageError(f"{index} lists {name}, which is not in {folder}")
        found, _ = safetensors_io.read_header(folder / name)
        tensors.update(found)
    for tensor, file in (weight_map or {}).items():
        if tensor not in tensors or tensors[tensor].path.name != file:
            raise UsageError(f"{index} places tensor {tensor} in {file}, which does not hold it")
    return mxfp4.unpacked(tensors)  # MXFP4 pairs (GPT-OSS's experts) read as their floats


def _check_tensors(
    tensors: dict[str, safetensors_io.TensorInfo],
    expected: list[Entry],
    cfg: ModelConfig,
    folder: Path,
    raw: dict[str, Any],
) -> None:
    wanted = {e.hf_name for e in expected}
    for entry in expected:  # a fused tensor's parts each check the whole tensor
        info = tensors.get(entry.hf_name)
        if info is None:
            raise UsageError(
                f"{folder} has no tensor {entry.hf_name}, which its config.json implies "
                f"({cfg.n_layers} layers, {getattr(cfg, 'n_experts', 0)} experts, "
                f"tie_word_embeddings={getattr(cfg, 'tie_embeddings', False)})"
            )
        if info.shape != entry.hf_shape:
            raise UsageError(
                f"{folder}: tensor {entry.hf_name} has shape {info.shape}, but config.json "
                f"implies {entry.hf_shape}"
            )
        code = safetensors_io.CODES[info.dtype]
        if code not in FLOAT_DTYPES:
            raise UsageError(f"{folder}: tensor {entry.hf_name} is {code}, not a float type")
    extra = sorted(
        name
        for name in tensors
        if name not in wanted
        and not name.endswith(IGNORED_SUFFIXES)
        and not (name == "lm_head.weight" and getattr(cfg, "tie_embeddings", False))
        and not prediction_layer(name, raw)
    )
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        architecture = (raw.get("architectures") or ["model"])[0]
        raise UsageError(
            f"{folder} holds tensor {extra[0]}{more}, which a {architecture} with this "
            f"config.json does not have; is it another architecture?"
        )


def prediction_layer(name: str, raw: dict[str, Any]) -> bool:
    """Whether tensor `name` belongs to a multi-token-prediction layer of a release
    (`num_nextn_predict_layers` of them after the decoder's: DeepSeek-V3's, GLM-4.5's), which
    transformers skips on load and spmd does not train."""
    extra, layers = raw.get("num_nextn_predict_layers") or 0, raw.get("num_hidden_layers")
    if not (isinstance(extra, int) and isinstance(layers, int) and extra > 0):
        return False
    prefix = "model.layers."
    index = name[len(prefix) :].split(".", 1)[0] if name.startswith(prefix) else ""
    return index.isdigit() and layers <= int(index) < layers + extra


def skipped_prediction_tensors(tensors: dict[str, Any], raw: dict[str, Any]) -> str:
    """The line that says a folder's multi-token-prediction tensors are skipped ("" if none)."""
    skipped = [name for name in tensors if prediction_layer(name, raw)]
    if not skipped:
        return ""
    return (
        f"skipping {len(skipped)} tensors of the {raw['num_nextn_predict_layers']} "
        f"multi-token-prediction layer(s) (num_nextn_predict_layers): spmd trains the "
        f"next-token head only"
    )


# --- loading onto a mesh ----------------------------------------------------------------


def load_params(checkpoint: HFCheckpoint, abstract_params: dict[str, Any]) -> dict[str, Any]:
    """The spmd params read from `checkpoint`, each a jax.Array with the dtype and sharding of
    its ShapeDtypeStruct in `abstract_params` (e.g. `program.abstract_params`); streamed so the
    host holds about one tensor at a time (see the module docstring)."""
    params: dict[str, Any] = {}
    by_path: dict[tuple[str, ...], list[Entry]] = {}
    for entry in entries(
        abstract_params, checkpoint.table, layer_groups.dense_of(checkpoint.config)
    ):
        by_path.setdefault(entry.path, []).append(entry)
    for path, layer_entries in by_path.items():
        target = get(abstract_params, path)

        def host(entry: Entry, dtype: Any = target.dtype) -> np.ndarray:
            value = entry.to_spmd(checkpoint.tensors[entry.hf_name].read(), np.dtype(dtype))
            check_finite(value, entry.hf_name, checkpoint.path)
            return value

        if layer_entries[0].layer is not None:  # rows of a stacked param
            value = _stacked(target, [(e.layer, lambda e=e: host(e)) for e in layer_entries])
        else:
            value = _to_devices(host(layer_entries[0]), target.sharding)
        put(params, path, value)
    if jax.tree.structure(params) != jax.tree.structure(abstract_params):
        raise ValueError("the HF tensor table does not cover every param of the model")
    return params


def check_finite(value: np.ndarray, name: str, folder: Path) -> None:
    """UsageError for a tensor holding NaN or infinities: such weights train and generate
    nothing but NaN, and a checkpoint made of them would pass for a good one."""
    if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
        bad = int(value.size - np.isfinite(value).sum())
        raise UsageError(
            f"{folder}: tensor {name} holds {bad} NaN or infinite value(s) of {value.size}; "
            f"spmd reads only finite weights"
        )


def _to_devices(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _stacked(
    target: jax.ShapeDtypeStruct, rows: list[tuple[tuple[int, ...], Callable[[], np.ndarray]]]
) -> jax.Array:
    """A [layers, ...] (or [layers, experts, ...]) device array in the target's sharding,
    filled one (index, read) row at a time."""
    sharding = target.sharding
    spec = tuple(sharding.spec) + (None,) * (len(target.shape) - len(sharding.spec))
    stacked = _zeros(target.shape, target.dtype, sharding)
    for index, read in rows:
        row_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[len(index) :]))
        row = _to_devices(read(), row_sharding)
        stacked = _write_row(stacked, row, index)
    return stacked


def _zeros(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    return _zeros_fn(shape, np.dtype(dtype), sharding)()


@functools.cache
def _zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _write_row(stacked: jax.Array, row: jax.Array, index: tuple[int, ...]) -> jax.Array:
    block = row.astype(stacked.dtype).reshape((1,) * len(index) + row.shape)
    return jax.lax.dynamic_update_slice(stacked, block, (*index, *(0,) * row.ndim))


# --- writing a folder -----------------------------------------------------------------


def save(
    params: dict[str, Any],
    config: dict[str, Any],
    directory: str,
    table: tuple[Rule, ...],
    dtype: str = "float32",
    max_shard_bytes: int = 4 << 30,
    dense: tuple[int, ...] = (),
) -> list[Path]:
    """Write `params` (spmd params, jax arrays on any mesh) as a Hugging Face folder:
    `config` as config.json and the tensors of `table` as safetensors in `dtype` ("float32"
    or "bfloat16"), in shards of at most `max_shard_bytes` with an index when there is more
    than one; `dense`: the dense-MLP layers of a model with two stacks (hf_tensors.entries).
    Refuses a folder that already holds a checkpoint. Returns the files written."""
    if dtype not in EXPORT_DTYPES:
        raise UsageError(f"--hf-dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    check_new_folder(directory)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    np_dtype = EXPORT_DTYPES[dtype]
    parts: dict[str, list[Entry]] = {}
    for entry in entries(params, table, dense):
        parts.setdefault(entry.hf_name, []).append(entry)
    plan = [group[0] for group in parts.values()]  # one per HF tensor, fused ones included
    shards = list(_shards(plan, np_dtype.itemsize, max_shard_bytes))
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )

    def part(entry: Entry) -> np.ndarray:
        value = get(params, entry.path)
        if entry.layer is not None:
            value = value[entry.layer]  # sliced on the devices: one layer comes to the host
        return entry.to_hf(np.asarray(jax.device_get(value)), np_dtype)

    def produce(hf_name: str) -> np.ndarray:
        group = parts[hf_name]
        return part(group[0]) if len(group) == 1 else np.concatenate([part(e) for e in group])

    total = 0
    written = []
    for name, shard in zip(names, shards, strict=True):
        listing = [(e.hf_name, e.hf_shape, np_dtype) for e in shard]
        total += safetensors_io.write(folder / name, listing, produce, {"format": "pt"})
        written.append(folder / name)
    if len(shards) > 1:
        weight_map = {
            e.hf_name: name for name, shard in zip(names, shards, strict=True) for e in shard
        }
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written.append(folder / INDEX_FILE)
    config_text = json.dumps(config, indent=2)
    (folder / "config.json").write_text(config_text + "\n")
    return [*written, folder / "config.json"]


def check_new_folder(directory: str) -> None:
    """UsageError if `directory` is a file or already holds a Hugging Face checkpoint."""
    folder = Path(directory)
    if folder.exists() and (
        not folder.is_dir()
        or any(folder.glob("*.safetensors*"))
        or (folder / "config.json").exists()
    ):
        raise UsageError(
            f"--to-hf {directory} is a file or already holds a checkpoint; give a new folder"
        )


def _shards(plan: list[Entry], itemsize: int, max_bytes: int) -> Iterator[list[Entry]]:
    shard: list[Entry] = []
    size = 0
    for entry in plan:
        nbytes = math.prod(entry.hf_shape) * itemsize
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append(entry)
        size += nbytes
    if shard:
        yield shard
