"""LoRA fine-tuning for the commands: the adapters a family offers (models/lora.py) and peft's
adapter folders both ways (models/peft.py), asked of a family record or a model config.

spmd imports from models/ only this module, the registry (models/family.py) and the contract
(models/contract.py): a family states its LoRA targets in its record, and nothing in spmd/
names a family's own module.

    lora_spec(family, rank, alpha, dropout, targets)   the adapters the --lora-* flags ask for
    with_lora(model, spec, tensors, seed)              a model with fresh adapters
    lora_loss / lora_metrics                           a family's functions on the adapted model
    with_reference                                     a preference objective's reference: the base
    read_peft / peft_targets / load_peft / save_peft   peft folders in and out
    unquantized / quantized_like                       a QLoRA base loaded, then quantized
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models import layer_groups, lora, nf4, peft
from models.contract import Family, ModelConfig
from models.family import hf_of, of

LoraSpec = lora.Spec
with_lora = lora.wrap  # (base model, spec, HF tensor table, seed) -> a LoraModel
lora_loss = lora.adapted_loss  # a family's loss -> the loss of a LoraModel's adapted model
lora_metrics = lora.adapted_metrics  # a family's step_metrics -> those of a LoraModel's
# (fn, reference, key) -> fn of a LoraModel with batch[key] = reference(its frozen base, batch)
with_reference = lora.with_reference
PeftAdapter = peft.Adapter
read_peft = peft.read_config  # a peft folder -> its PeftAdapter (adapter_config.json)
# a QLoRA base read from a Hugging Face folder: its unquantized abstract, then its codes
unquantized = nf4.unquantized
NF4_BLOCK = nf4.BLOCK  # values per scale, along embed
quantized_like = nf4.quantized_like


def lora_spec(
    family: Family, rank: int, alpha: float, dropout: float, targets: str, base_dtype: str = ""
) -> lora.Spec | None:
    """The adapters the --lora-* flags ask of `family` (None at rank 0); UsageError naming a
    bad value or a target the family lacks, with the valid ones."""
    table, default = family.lora_targets, family.lora_default
    return lora.spec_of(table, default, family.name, rank, alpha, dropout, targets, base_dtype)


def save_peft(
    adapters: dict[str, Any], spec: lora.Spec, cfg: ModelConfig, directory: str, base: str
) -> list[Path]:
    """Write `adapters` (host arrays) of a model `cfg` as a peft LoRA folder (models/peft.py)
    for base `base`; UsageError for a family with no Hugging Face Linear names."""
    dense = layer_groups.dense_of(cfg)
    return peft.save(adapters, spec, hf_of(cfg).tensors, directory, base, dense)


def peft_targets(adapter: peft.Adapter, cfg: ModelConfig) -> str:
    """The --lora-targets value (a comma list) of peft `adapter`'s target_modules on a model
    `cfg`: the same table --to-peft writes them from, read the other way."""
    fam = of(cfg)
    names = peft.target_names(adapter, fam.lora_targets, hf_of(cfg).tensors, fam.name)
    return ",".join(names)


def load_peft(directory: str, spec: lora.Spec, cfg: ModelConfig, like: dict[str, Any]) -> dict:
    """The adapters (fp32 host arrays shaped as `like`'s) of peft folder `directory` for a
    model `cfg` and adapters `spec`."""
    return peft.load(directory, spec, hf_of(cfg).tensors, like, layer_groups.dense_of(cfg))
