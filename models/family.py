"""The registry of model families: one line per family, and the lookups every command, the
builder and the library use instead of importing a family's modules (models/contract.py says
what a family provides; docs/extending.md how to add one).

    family.get("moe")            the family called "moe" (UsageError naming the valid ones)
    family.of(cfg)               the family of a config, by its type
    family.config_from_dict(d)   a checkpoint's saved [model] section as its family's config
    family.open_hf(folder)       a Hugging Face folder, read by the family its config.json names
    family.load_hf / save_hf     its tensors onto a mesh, and params out to a new folder

A family's record states only what differs from a Llama's (models/contract.Family's defaults);
LoRA and peft, asked of a family, are models/finetune.py's.

Llama 3.x, Mistral, Qwen2 / Qwen2.5 and Qwen3 are the llama family: switches of LlamaConfig
(rope scaling, sliding_window, qkv_bias, qk_norm), not families of their own, because nothing
the engine or the estimators ask of a family differs between them; only the Hugging Face
architecture does, and models/hf_config.py reads and writes it from the switches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from models import (
    gemma2,
    gemma3,
    glm4_moe,
    gpt_oss,
    hf_config,
    hf_io,
    hf_mixtral,
    layer_groups,
    llama,
    lora,
    moe,
    olmo2,
    phi3,
    qwen3_moe,
)
from models.contract import CausalLM, Decoder, Family, HFMapping, ModelConfig
from spmd.errors import UsageError

__all__ = ["CausalLM", "Decoder", "Family", "HFMapping", "ModelConfig"]

EXPORT_DTYPES = hf_io.EXPORT_DTYPES  # the dtypes --to-hf writes

LLAMA = Family(  # the defaults of models/contract.Family are its own
    name="llama",
    config=llama.LlamaConfig,
    check=llama.check,
    check_layout=llama.check_layout,
    hf=HFMapping(
        model_types=hf_config.MODEL_TYPES,
        config_from_hf=hf_config.llama_config,
        config_to_hf=hf_config.hf_config,
        tensors=hf_config.TENSORS,
    ),
)
MOE = Family(
    name="moe",
    config=moe.MoEConfig,
    create=moe.create,
    # a pipeline passes only activations between stages, so its last stage scores the logits
    # alone with the llama's logits_loss (moe.check_layout refuses the router losses with pp > 1)
    loss=moe.lm_loss,
    check=moe.check,
    check_layout=moe.check_layout,
    hf=HFMapping(
        model_types={"mixtral": hf_mixtral.ARCHITECTURE},
        config_from_hf=hf_mixtral.mixtral_config,
        config_to_hf=hf_mixtral.moe_hf_config,
        tensors=hf_config.TENSORS + hf_mixtral.TENSORS,
    ),
    step_metrics=moe.router_stats,
    lora_targets=lora.ATTENTION,  # adapters on attention: the experts' weights are not targets
)

# The registry: one line per family.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        LLAMA,
        MOE,
        gemma2.FAMILY,
        gemma3.FAMILY,
        phi3.FAMILY,
        qwen3_moe.FAMILY,
        olmo2.FAMILY,
        glm4_moe.FAMILY,
        gpt_oss.FAMILY,
    )
}


def get(name: str) -> Family:
    """The family called `name`; UsageError naming the valid ones otherwise."""
    if name not in FAMILIES:
        raise UsageError(f"model family {name!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def of(cfg: ModelConfig) -> Family:
    """The family of config `cfg`, by its type (an MoEConfig is "moe" even with n_experts 0:
    moe.create builds the dense Llama then)."""
    for family in FAMILIES.values():
        if type(cfg) is family.config:
            return family
    raise UsageError(
        f"{type(cfg).__name__} is no model family's config; the families are "
        f"{', '.join(f'{f.name} ({f.config.__name__})' for f in FAMILIES.values())}"
    )


def family_name(saved: dict[str, Any]) -> str:
    """The family of a saved [model] section: its `family` key, or for a checkpoint written
    before families had names "moe" when it has experts, else "llama"."""
    if "family" in saved:
        return saved["family"]
    return "moe" if saved.get("n_experts", 0) > 0 else "llama"


def check_fields(values: dict[str, Any], source: str) -> type:
    """The config class of the family `values` name (default "llama"); UsageError naming a
    given field that family's config does not have (e.g. n_experts on a dense Llama)."""
    family = get(values.get("family", "llama"))
    own = {f.name for f in dataclasses.fields(family.config)}
    for key in sorted(set(values) - own):
        owners = [f.name for f in FAMILIES.values() if key in _fields(f.config)]
        where = f"a field of the {' and '.join(owners)} family" if owners else "no model field"
        raise UsageError(
            f"{source}: {key} is {where}, and this model is family {family.name!r}"
            + (f" (set --family {owners[0]})" if owners else "")
        )
    return family.config


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def config_from_dict(saved: dict[str, Any]) -> Any:
    """A checkpoint's saved [model] section as its family's config. Fields of another family's
    config (a dense run saved through MoEConfig keeps n_experts 0 and the router knobs) are
    left out; a key no family knows is a UsageError."""
    family = get(family_name(saved))
    own = {f.name for f in dataclasses.fields(family.config)}
    known = {f.name for fam in FAMILIES.values() for f in dataclasses.fields(fam.config)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise UsageError(
            f"the saved model section has {', '.join(unknown)}, which no model family's config "
            f"({', '.join(FAMILIES)}) has"
        )
    kept = {k: v for k, v in saved.items() if k in own}
    return family.config(**(kept | {"family": family.name}))


# --- Hugging Face folders ---------------------------------------------------------------


def architecture_of(raw: dict[str, Any], where: str = "config.json") -> str:
    """The architecture a config.json names: its first `architectures` entry, or the one its
    model_type stands for when it names none. UsageError when both name architectures spmd
    reads and they differ: transformers builds the model its model_type names, so the two must
    agree for spmd to read what transformers reads."""
    types = {t: a for f in FAMILIES.values() if f.hf for t, a in f.hf.model_types.items()}
    model_type = raw.get("model_type")
    known = isinstance(model_type, str) and model_type in types
    names = raw.get("architectures")
    if isinstance(names, list) and names:
        if known and str(names[0]) in types.values() and types[model_type] != str(names[0]):
            raise UsageError(
                f"{where}: architectures names {names[0]} but model_type {model_type!r} is "
                f"{types[model_type]}'s; make the two agree"
            )
        return str(names[0])
    return types[model_type] if known else f"model_type {model_type!r}"


def for_hf(raw: dict[str, Any], where: str) -> Family:
    """The family that reads config.json `raw`; UsageError naming its architecture and every
    one spmd reads otherwise."""
    architecture = architecture_of(raw, where)
    for family in FAMILIES.values():
        if family.hf and architecture in family.hf.architectures:
            return family
    known = [a for f in FAMILIES.values() if f.hf for a in f.hf.architectures]
    raise UsageError(
        f"{where}: architecture {architecture} is not supported; spmd converts {', '.join(known)}"
    )


def open_hf(directory: str, remat: str = "none") -> hf_io.HFCheckpoint:
    """A Hugging Face folder checked against the family its config.json names (headers only,
    no tensor data): UsageError naming the architecture, a field the family does not compute,
    or a missing, misshapen or unexpected tensor."""
    raw, cfg = _read_hf_config(directory, remat)
    family = of(cfg)
    assert family.hf is not None
    return hf_io.open_checkpoint(directory, raw, cfg, family.name, family.create, family.hf.tensors)


def hf_model_config(directory: str, remat: str = "none") -> Any:
    """The model config of a Hugging Face folder's config.json alone (no tensor is read, none
    need be there: what spmd.plan plans from), by the family the file names; UsageError as
    `open_hf` for a file no family reads."""
    return _read_hf_config(directory, remat)[1]


def _read_hf_config(directory: str, remat: str) -> tuple[dict[str, Any], Any]:
    """(config.json of `directory`, the checked model config its family reads from it)."""
    raw = hf_io.read_config(directory)
    where = str(Path(directory) / "config.json")
    family = for_hf(raw, where)
    assert family.hf is not None
    cfg = family.hf.config_from_hf(raw, where, remat)
    family.check(cfg)
    return raw, cfg


def load_hf(checkpoint: hf_io.HFCheckpoint, abstract_params: dict[str, Any]) -> dict[str, Any]:
    """The params of `checkpoint` on the dtypes and shardings of `abstract_params`, streamed
    (models/hf_io.py)."""
    return hf_io.load_params(checkpoint, abstract_params)


def hf_of(cfg: ModelConfig) -> HFMapping:
    """The Hugging Face mapping of model `cfg`'s family; UsageError for a family with none."""
    fam = of(cfg)
    if fam.hf is None:
        raise UsageError(f"model family {fam.name!r} has no Hugging Face architecture")
    return fam.hf


def save_hf(
    params: dict[str, Any],
    cfg: ModelConfig,
    directory: str,
    dtype: str = "float32",
    max_shard_bytes: int = 4 << 30,
    max_positions: int = 2048,
) -> list[Path]:
    """Write `params` of model `cfg` as a Hugging Face folder of its family's architecture
    (config.json and safetensors in `dtype`); UsageError for a family or config no
    architecture computes. Returns the files written."""
    hf = hf_of(cfg)
    if dtype not in EXPORT_DTYPES:
        raise UsageError(f"--hf-dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    hf_io.check_new_folder(directory)
    config = hf.config_to_hf(cfg, dtype, max_positions)
    dense = layer_groups.dense_of(cfg)
    return hf_io.save(params, config, directory, hf.tensors, dtype, max_shard_bytes, dense)


def check_new_folder(directory: str) -> None:
    """UsageError if `directory` is a file or already holds a Hugging Face checkpoint."""
    hf_io.check_new_folder(directory)
