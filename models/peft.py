"""Hugging Face peft's LoRA adapter folder, both ways: adapter_config.json and
adapter_model.safetensors.

peft names each adapted Linear by its module path under the wrapped model,
`base_model.model.<HF module>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]), with
the scale lora_alpha / r. The HF module of an spmd target comes from the family's tensor table
(`model.layers.{}.self_attn.q_proj.weight` -> `...q_proj`); spmd's A [layers, *in, r] gives
one lora_A per layer, and the B's of a target's paths, concatenated along the output in table
order, its lora_B (a fused projection: Phi-3's qkv_proj).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from models.hf_tensors import STACKED, Rule
from models.lora import Spec
from spmd.errors import UsageError
from spmd.io import safetensors_io

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def modules(spec: Spec, tensors: tuple[Rule, ...]) -> dict[str, str]:
    """Target name -> its HF module name with "{}" for the layer (the table's tensor name
    without `.weight`). UsageError for a target whose weight the table does not name once."""
    out = {}
    for name, paths in spec.targets.items():
        hf = {n for p, n, _ in tensors if p in paths}
        if len(hf) != 1 or paths[0][0] != STACKED:
            raise UsageError(f"LoRA target {name!r} has no single Hugging Face Linear to export")
        out[name] = hf.pop().removesuffix(".weight")
    return out


def peft_tensors(adapters: dict[str, Any], spec: Spec, tensors: tuple[Rule, ...]) -> dict:
    """{peft tensor name: fp32 numpy array} of spmd adapters (a pure dict of host arrays)."""
    out = {}
    for name, module in modules(spec, tensors).items():
        a = np.asarray(adapters[name]["a"], np.float32)
        bs = [np.asarray(adapters[name]["b"][p[-1]], np.float32) for p in spec.targets[name]]
        for layer in range(a.shape[0]):
            key = PREFIX + module.format(layer)
            out[f"{key}.lora_A.weight"] = a[layer].reshape(-1, spec.rank).T
            b = np.concatenate([b[layer].reshape(spec.rank, -1) for b in bs], axis=1)
            out[f"{key}.lora_B.weight"] = b.T
    return out


def save(
    adapters: dict[str, Any],
    spec: Spec,
    tensors: tuple[Rule, ...],
    directory: str,
    base: str,
) -> list[Path]:
    """Write a peft LoRA folder of `adapters` for base model `base` (a path or Hub id)."""
    folder = Path(directory)
    if (folder / CONFIG).exists() or folder.is_file():
        raise UsageError(f"--to-peft {directory} already holds an adapter or is a file")
    folder.mkdir(parents=True, exist_ok=True)
    values = {k: np.ascontiguousarray(v) for k, v in peft_tensors(adapters, spec, tensors).items()}
    entries = [(k, v.shape, v.dtype) for k, v in values.items()]
    safetensors_io.write(folder / WEIGHTS, entries, values.__getitem__, {"format": "pt"})
    targets = sorted({m.format(0).rsplit(".", 1)[-1] for m in modules(spec, tensors).values()})
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


def load(directory: str, spec: Spec, tensors: tuple[Rule, ...], like: dict[str, Any]) -> dict:
    """spmd adapters (a pure dict of numpy arrays shaped as `like`'s) from a peft folder."""
    found, _ = safetensors_io.read_header(Path(directory) / WEIGHTS)
    names = {k.replace(".default.", "."): v for k, v in found.items()}
    out: dict[str, Any] = {}
    for name, module in modules(spec, tensors).items():
        a_like, b_like = like[name]["a"], like[name]["b"]
        layers = a_like.shape[0]
        a = np.zeros(a_like.shape, np.float32)
        bs = {k: np.zeros(v.shape, np.float32) for k, v in b_like.items()}
        for layer in range(layers):
            key = PREFIX + module.format(layer)
            for suffix in ("lora_A", "lora_B"):
                if f"{key}.{suffix}.weight" not in names:
                    raise UsageError(f"{directory}: {key}.{suffix}.weight is missing")
            a[layer] = names[f"{key}.lora_A.weight"].read().T.reshape(a.shape[1:])
            b = names[f"{key}.lora_B.weight"].read().T  # [r, out...]
            start = 0
            for path in spec.targets[name]:
                part = bs[path[-1]][layer]
                width = part[0].size
                part[...] = b[:, start : start + width].reshape(part.shape)
                start += width
        out[name] = {"a": a, "b": bs}
    return out
