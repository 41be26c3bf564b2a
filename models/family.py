"""Model families: what the engine and the estimators may know of a model, in one record each.

A `Family` names a model's config dataclass (the [model] section of a run) and the functions
that build it, score it and describe it: its parameter and FLOP counts, its `ModelShape` (the
one set of sizes spmd.estimate reads), its params' logical axes, its Hugging Face mapping, the
layouts it refuses and the statistics it logs each step. The engine asks the family instead of
probing a config for fields.

    family.get("moe")            the family called "moe" (UsageError naming the valid ones)
    family.of(cfg)               the family of a config, by its type
    family.config_from_dict(d)   a checkpoint's saved [model] section as its family's config

Llama 3.x, Mistral, Qwen2 / Qwen2.5 and Qwen3 are the llama family: switches of LlamaConfig
(rope scaling, sliding_window, qkv_bias, qk_norm), not families of their own, because nothing
the engine or the estimators ask of a family differs between them; only the Hugging Face
architecture does, and models/hf_config.py reads and writes it from the switches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flax import nnx

from models import hf_config, hf_llama, hf_mixtral, llama, moe
from spmd.errors import UsageError
from spmd.model_shape import ModelShape


@dataclasses.dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face checkpoint mapping (models/hf_llama.py streams the tensors of
    both families; the config.json translation is per family)."""

    config_from_hf: Callable[..., Any]  # (config.json dict, where, remat) -> config
    config_to_hf: Callable[..., dict]  # (config, dtype name, max positions) -> config.json dict
    open_checkpoint: Callable[..., Any] = hf_llama.open_checkpoint  # (folder, remat) -> HF folder
    load_params: Callable[..., Any] = hf_llama.load_params  # (HF folder, abstract params)
    save: Callable[..., Any] = hf_llama.save  # (params, config, folder, dtype, ...) -> files


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family. Counts are parameters (scalars); FLOPs are per trained token."""

    name: str
    config: type  # the config dataclass: the run's [model] section
    create: Callable[..., nnx.Module]  # (cfg, seed, dtype) -> a freshly initialised model
    loss: Callable[[Any, dict], Any]  # (model, batch) -> the scalar training loss (fp32)
    logits_loss: Callable[..., Any]  # a pipeline's last-stage loss (llama.logits_loss's form)
    hf: HFMapping
    check_layout: Callable[[Any, Any, str], None]  # (cfg, mesh, executor): UsageError if refused
    check: Callable[[Any], None]  # (cfg): UsageError if it cannot be built (before device work)
    step_metrics: Callable[[Any, dict], dict] | None = None  # (model, batch) -> logged figures

    def shape(self, cfg: Any) -> ModelShape:
        """The sizes spmd.estimate reads."""
        return cfg.shape()

    def n_params(self, cfg: Any) -> int:
        """Parameters of the model (every expert included)."""
        return cfg.n_params()

    def n_active_params(self, cfg: Any) -> int:
        """Parameters one token uses (an MoE's k routed experts, not all E)."""
        return cfg.n_active_params()

    def flops_per_token(self, cfg: Any, seq_len: int) -> float:
        """Model FLOPs (forward + backward) per trained token (ModelShape.flops_per_token)."""
        return self.shape(cfg).flops_per_token(seq_len)

    def param_axes(self, cfg: Any) -> dict[str, tuple]:
        """{param path "blocks/attn/wq": its logical axis names}, read from an abstract model
        (nnx.eval_shape: no param is allocated)."""
        abstract = nnx.eval_shape(lambda: self.create(cfg, 0))
        flat = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
        return {
            "/".join(str(p) for p in path): tuple(var.get_metadata().get("out_sharding") or ())
            for path, var in flat
        }


LLAMA = Family(
    name="llama",
    config=llama.LlamaConfig,
    create=llama.create,
    loss=llama.lm_loss,
    logits_loss=llama.logits_loss,
    hf=HFMapping(config_from_hf=hf_config.llama_config, config_to_hf=hf_config.hf_config),
    check_layout=llama.check_layout,
    check=llama.check,
)
MOE = Family(
    name="moe",
    config=moe.MoEConfig,
    create=moe.create,
    loss=moe.lm_loss,
    # a pipeline passes only activations between stages, so its last stage scores the logits
    # alone (moe.check_layout refuses the router losses with pp > 1)
    logits_loss=llama.logits_loss,
    hf=HFMapping(
        config_from_hf=hf_mixtral.mixtral_config, config_to_hf=hf_mixtral.mixtral_hf_config
    ),
    check_layout=moe.check_layout,
    check=moe.check,
    step_metrics=moe.router_stats,
)
FAMILIES = {f.name: f for f in (LLAMA, MOE)}


def get(name: str) -> Family:
    """The family called `name`; UsageError naming the valid ones otherwise."""
    if name not in FAMILIES:
        raise UsageError(f"model family {name!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def of(cfg: Any) -> Family:
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
