"""Hugging Face peft's LoRA adapter folder, both ways: adapter_config.json and
adapter_model.safetensors.

peft names each adapted Linear by its module path under the wrapped model,
`base_model.model.<HF module>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]), with
the scale lora_alpha / r. The HF module of an spmd target comes from the family's tensor table
(`model.layers.{}.self_attn.q_proj.weight` -> `...q_proj`); spmd's A [layers, *in, r] gives
one lora_A per layer, and the B's of a target's paths, concatenated along the output in table
order, its lora_B (a fused projection: Phi-3's qkv_proj).

Reading a folder back (`--init-from-peft`) goes through the same table the other way:
adapter_config.json's `target_modules` (`q_proj`, or a longer dotted tail of the module path
such as `self_attn.q_proj`) name the targets whose HF module ends so. Only peft's plain LoRA is
read: a feature that changes what the adapter computes or which weights it holds (DoRA,
rsLoRA's scale, biases, per-module ranks, modules trained in full, a layer subset, ...) is a
UsageError naming it, rather than an adapter silently read as something else.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from models import layer_groups
from models.hf_tensors import STACKED, Rule
from models.lora import TWIN, Spec
from spmd.errors import UsageError
from spmd.io import safetensors_io

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def modules(
    targets: dict[str, tuple[tuple[str, ...], ...]], tensors: tuple[Rule, ...]
) -> dict[str, str]:
    """Target name -> its HF module name with "{}" for the layer (the table's tensor name
    without `.weight`), for `targets` (a family's lora_targets or a Spec's). UsageError for a
    target whose weight the table does not name once."""
    out = {}
    for name, paths in targets.items():
        hf = {n for p, n, _ in tensors if p in paths}
        if len(hf) != 1 or paths[0][0] != STACKED:
            raise UsageError(f"LoRA target {name!r} has no single Hugging Face Linear to export")
        out[name] = hf.pop().removesuffix(".weight")
    return out


def stacks_of(adapters: dict[str, Any], name: str, dense: tuple[int, ...]) -> list:
    """(key in `adapters`, the model's layer of each of its rows) of target `name`'s adapters:
    one stack's, or with `dense` (a model's dense-MLP layers) the sparse stack's and its twin's
    on the dense stack (models/lora.TWIN), each row numbered by its model layer."""
    twin = name + TWIN
    rows = {key: np.shape(adapters[key]["a"])[0] for key in (name, twin) if key in adapters}
    if len(rows) == 1:
        return [(name, list(range(rows[name])))]
    total = sum(rows.values())
    return [
        (name, layer_groups.stack_layers(dense, total, False)),
        (twin, layer_groups.stack_layers(dense, total, True)),
    ]


def peft_tensors(
    adapters: dict[str, Any], spec: Spec, tensors: tuple[Rule, ...], dense: tuple[int, ...] = ()
) -> dict:
    """{peft tensor name: fp32 numpy array} of spmd adapters (a pure dict of host arrays);
    `dense`: the dense-MLP layers of a model of two stacks."""
    out = {}
    for name, module in modules(spec.targets, tensors).items():
        for key, layers in stacks_of(adapters, name, dense):
            a = np.asarray(adapters[key]["a"], np.float32)
            bs = [np.asarray(adapters[key]["b"][p[-1]], np.float32) for p in spec.targets[name]]
            for row, layer in enumerate(layers):
                hf = PREFIX + module.format(layer)
                out[f"{hf}.lora_A.weight"] = a[row].reshape(-1, spec.rank).T
                b = np.concatenate([b[row].reshape(spec.rank, -1) for b in bs], axis=1)
                out[f"{hf}.lora_B.weight"] = b.T
    return dict(sorted(out.items(), key=lambda item: _layer_key(item[0])))


def _layer_key(name: str) -> tuple[int, str]:
    """Sort key of a peft tensor name: its layer, then the name (peft lists them by layer)."""
    digits = name.removeprefix(PREFIX + "model.layers.").split(".", 1)[0]
    return (int(digits) if digits.isdigit() else -1, name)


def save(
    adapters: dict[str, Any],
    spec: Spec,
    tensors: tuple[Rule, ...],
    directory: str,
    base: str,
    dense: tuple[int, ...] = (),
) -> list[Path]:
    """Write a peft LoRA folder of `adapters` for base model `base` (a path or Hub id);
    `dense`: the dense-MLP layers of a model of two stacks."""
    folder = Path(directory)
    if (folder / CONFIG).exists() or folder.is_file():
        raise UsageError(f"--to-peft {directory} already holds an adapter or is a file")
    folder.mkdir(parents=True, exist_ok=True)
    found = peft_tensors(adapters, spec, tensors, dense)
    values = {k: np.ascontiguousarray(v) for k, v in found.items()}
    entries = [(k, v.shape, v.dtype) for k, v in values.items()]
    safetensors_io.write(folder / WEIGHTS, entries, values.__getitem__, {"format": "pt"})
    targets = sorted({short_name(m) for m in modules(spec.targets, tensors).values()})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [folder / WEIGHTS, folder / CONFIG]


def load(
    directory: str,
    spec: Spec,
    tensors: tuple[Rule, ...],
    like: dict[str, Any],
    dense: tuple[int, ...] = (),
) -> dict:
    """spmd adapters (a pure dict of fp32 numpy arrays shaped as `like`'s: arrays or
    ShapeDtypeStructs) from a peft folder; `dense`: the dense-MLP layers of a model of two
    stacks. UsageError for a missing or misshapen tensor, or one that is no adapter of
    `spec`'s targets."""
    found, _ = safetensors_io.read_header(Path(directory) / WEIGHTS)
    names = {k.replace(".default.", "."): v for k, v in found.items()}
    used: set[str] = set()
    out: dict[str, Any] = {}
    for name, module in modules(spec.targets, tensors).items():
        for key, layers in stacks_of(like, name, dense):
            a_like, b_like = like[key]["a"], like[key]["b"]
            a = np.zeros(a_like.shape, np.float32)
            bs = {k: np.zeros(v.shape, np.float32) for k, v in b_like.items()}
            width = sum(math.prod(b.shape[2:]) for b in bs.values())  # B [layers, r, *out]
            for row, layer in enumerate(layers):
                hf = PREFIX + module.format(layer)
                a_name, b_name = f"{hf}.lora_A.weight", f"{hf}.lora_B.weight"
                a[row] = _tensor(
                    names, a_name, (spec.rank, a[row].size // spec.rank), directory
                ).T.reshape(a.shape[1:])
                b = _tensor(names, b_name, (width, spec.rank), directory).T  # [r, out]
                used.update((a_name, b_name))
                start = 0
                for path in spec.targets[name]:
                    part = bs[path[-1]][row]
                    size = part[0].size
                    part[...] = b[:, start : start + size].reshape(part.shape)
                    start += size
            out[key] = {"a": a, "b": bs}
    extra = sorted(set(names) - used)
    if extra:
        raise UsageError(
            f"{directory}: {extra[0]} (and {len(extra) - 1} more) is no adapter of the targets "
            f"{', '.join(spec.targets)} that adapter_config.json's target_modules name"
        )
    return out


def _tensor(names: dict[str, Any], name: str, shape: tuple[int, ...], directory: str) -> Any:
    """Tensor `name` of a peft folder's file, checked to be `shape`."""
    if name not in names:
        raise UsageError(f"{directory}: {name} is missing from {WEIGHTS}")
    if tuple(names[name].shape) != shape:
        raise UsageError(
            f"{directory}: {name} is {list(names[name].shape)}, where r and the base's shapes "
            f"need {list(shape)}"
        )
    return names[name].read()


# adapter_config.json's keys for what spmd does not read, each set (true, or non-empty) only
# when the adapter uses it: what it is
UNSUPPORTED = {
    "use_dora": "DoRA, a learned magnitude per output",
    "use_rslora": "rsLoRA, the scale lora_alpha / sqrt(r)",
    "lora_bias": "a bias on lora_B",
    "fan_in_fan_out": "weights stored [in, out], as GPT-2's Conv1D",
    "modules_to_save": "modules trained in full beside the adapters",
    "rank_pattern": "ranks per module",
    "alpha_pattern": "alphas per module",
    "layers_to_transform": "adapters on some layers only",
    "exclude_modules": "modules left out of target_modules' match",
    "layer_replication": "layers replicated by peft",
    "target_parameters": "adapters on parameters (MoE experts)",
    "trainable_token_indices": "embedding rows trained beside the adapters",
    "alora_invocation_tokens": "activated LoRA",
}


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A peft LoRA folder's adapter_config.json as spmd reads it: the base
    (base_model_name_or_path; "" when it names none), rank r, lora_alpha, lora_dropout and
    target_modules (HF module names or dotted tails of them)."""

    folder: str
    base: str
    rank: int
    alpha: float
    dropout: float
    modules: tuple[str, ...]


def read_config(directory: str) -> Adapter:
    """The Adapter of peft folder `directory` (no tensor read); UsageError, one line, for a
    folder without peft's two files, an adapter that is not LoRA, or a feature in UNSUPPORTED."""
    where = f"--init-from-peft {directory}"
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise UsageError(
            f"{where}: no {CONFIG} there; a peft adapter folder holds {CONFIG} and {WEIGHTS}"
        )
    if not (Path(directory) / WEIGHTS).is_file():
        raise UsageError(
            f"{where}: no {WEIGHTS} there (an adapter saved as .bin: save it again with "
            f"peft's default safe_serialization=True)"
        )
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{path} is not JSON: {error}") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else raw
        raise UsageError(f"{path}: peft_type {kind!r} is not a LoRA adapter (peft_type LORA)")
    for key, what in UNSUPPORTED.items():
        if raw.get(key):
            raise UsageError(f"{path}: {key} = {json.dumps(raw[key])} ({what}) is not supported")
    if raw.get("bias", "none") != "none":
        raise UsageError(
            f'{path}: bias = {raw["bias"]!r} (trained base biases) is not supported; only "none"'
        )
    rank, alpha, dropout = raw.get("r"), raw.get("lora_alpha", 8), raw.get("lora_dropout", 0.0)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise UsageError(f"{path}: r = {rank!r} is not a positive rank")
    for key, value in (("lora_alpha", alpha), ("lora_dropout", dropout)):
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise UsageError(f"{path}: {key} = {value!r} is not a number")
    if alpha <= 0:
        # peft's scale is lora_alpha / r: 0 adds nothing to the base and, both gradients
        # carrying the scale, trains nothing; spmd's --lora-alpha 0 means 2 x r instead, so
        # reading it would compute another adapter
        why = (
            "peft's scale lora_alpha / r = 0 adds and trains nothing, and spmd's --lora-alpha 0 "
            "would read it as 2 x r"
            if alpha == 0
            else f"peft's scale lora_alpha / r = {alpha / rank:g}, which --lora-alpha does not take"
        )
        raise UsageError(f"{path}: lora_alpha = {alpha:g} is not positive ({why}); set one > 0")
    if not 0 <= dropout < 1:
        raise UsageError(f"{path}: lora_dropout = {dropout} is not a probability in [0, 1)")
    targets = raw.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise UsageError(
            f"{path}: target_modules = {json.dumps(targets)} is not a list of module names "
            f'(a regular expression or "all-linear" is not read: list the modules)'
        )
    base = raw.get("base_model_name_or_path") or ""
    if not isinstance(base, str):
        raise UsageError(f"{path}: base_model_name_or_path = {base!r} is not a path or Hub id")
    check_tensors(Path(directory) / WEIGHTS)
    return Adapter(str(directory), base, rank, float(alpha), float(dropout), tuple(targets))


# the dtypes an adapter's tensors may come in: they are read into the fp32 master
FLOATS = tuple(safetensors_io.DTYPES[code] for code in ("F64", "F32", "F16", "BF16"))


def check_tensors(path: Path) -> None:
    """UsageError naming the first tensor of adapter file `path` that is not floating point
    (an int8 adapter would be cast, its quantization scales lost) or holds a value that is not
    finite (training from it diverges at the first step). Every value is read: an adapter is
    small (MBs), and this runs before the base is loaded or anything compiled."""
    found, _ = safetensors_io.read_header(path)
    for name, info in found.items():
        if info.dtype not in FLOATS:
            kind = safetensors_io.CODES[info.dtype]
            raise UsageError(
                f"{path}: {name} is stored as {kind}; peft's LoRA tensors are read in "
                f"F32, F16, BF16 or F64 (a quantized adapter is not read)"
            )
        values = info.read().astype(np.float32)  # as the master holds them
        bad = values.size - np.count_nonzero(np.isfinite(values))
        if bad:
            raise UsageError(f"{path}: {name} holds {bad} values that are not finite (NaN or inf)")


def short_name(module: str) -> str:
    """The last name of HF module path `module` (`model.layers.{}.self_attn.q_proj` -> `q_proj`):
    what adapter_config.json's target_modules lists."""
    return module.rsplit(".", 1)[-1]


def target_names(
    adapter: Adapter,
    table: dict[str, tuple[tuple[str, ...], ...]],
    tensors: tuple[Rule, ...],
    family: str,
) -> tuple[str, ...]:
    """The targets of family `family` (lora_targets `table`, HF tensor table `tensors`) that the
    adapter's target_modules name, in the table's order: an entry names a target when the
    target's HF module path ends with `.` + the entry, as peft matches them. UsageError naming
    an entry that matches none, with the valid names."""
    known = modules(table, tensors)
    found: set[str] = set()
    for entry in adapter.modules:
        hits = {name for name, module in known.items() if module.endswith("." + entry)}
        if not hits:
            valid = ", ".join(short_name(m) for m in known.values())
            raise UsageError(
                f"--init-from-peft {adapter.folder}: target module {entry!r} is not a LoRA "
                f"target of the {family} family; valid: {valid}"
            )
        found |= hits
    return tuple(name for name in known if name in found)
