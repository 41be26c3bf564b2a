"""The model contract: what a model family gives spmd, as types a type checker reads.

A family is one record (`Family`) of plain functions and tables, registered by one line in
models/family.py. The engine, the estimators, the commands and the library reach a model only
through it; none of them imports a family's own modules. docs/extending.md walks through
adding one.

    Family              the record: config class, create, loss, checks, HF mapping, decoder;
                        whatever a record leaves out is the llama's
    ModelConfig         what a family's config dataclass (the run's [model] section) provides
    CausalLM            what the module `create` returns provides: the forward pass and its
                        three pipeline pieces
    HFMapping           Hugging Face config.json and tensors, both ways
    Decoder             the key/value-cache forward pass that spmd.generate runs

A family's params carry their logical axis names themselves (`nnx.Param(...,
out_sharding=("embed", "mlp"))`, models/layers.param): the engine reads them from the model
`create` builds (spmd.engine.abstract), so the contract needs no separate table of axes.

A family's `(model, batch)` functions (`loss`, `step_metrics`) take the module its `create`
returns, never a LoRA model: under LoRA the builder runs them on the adapted model
(models/lora.py: `adapted_loss`, `adapted_metrics`), so a family may use any method of its own
model, not only the CausalLM pieces. Callers take them from the run's `spmd.run.builder.ModelSpec`
(`run_model(cfg)`), which holds them made for the model it builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

from models import llama, llama_decode, lora
from models.hf_tensors import Rule
from spmd.model_shape import ModelShape


class ModelConfig(Protocol):
    """A family's config: a frozen dataclass whose fields are the run's [model] section (and
    the training command's model flags, with help from each field's comment). Sizes are
    counts."""

    # a dataclass (dataclasses.replace and fields work on every family's config)
    __dataclass_fields__: ClassVar[dict[str, Any]]
    family: str  # the registered family name (models.family.get)
    n_layers: int  # stacked blocks: a pipeline splits them
    remat: str  # what the backward pass keeps of each block (models.layers.REMAT_POLICIES)

    def shape(self) -> ModelShape:
        """The sizes the estimators read (memory, FLOPs, collective volumes) and the parameter
        count (ModelShape.n_params: Family.n_params)."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """The module a family's `create` returns: token ids [batch, length] int32 -> fp32 logits
    [batch, length, vocab]. Its blocks are stacked on a leading `layers` dim under the
    attribute `blocks` (a pipeline stage holds a slice of them), and the forward pass is the
    three pieces below in order, which a pipeline runs on separate stages."""

    cfg: Any
    dtype: Any

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None) -> jax.Array: ...

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Token ids -> activations [batch, length, embed] in the compute dtype."""
        ...

    def apply_blocks(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """Every block `self.blocks` holds, in order; `segments`: document ids of packed rows."""
        ...

    def head_logits(self, x: jax.Array) -> jax.Array:
        """Activations -> fp32 logits (final norm and output head)."""
        ...


@dataclasses.dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face checkpoints: which architectures it reads and writes, config.json
    both ways and its tensor table (models/hf_io.py streams the tensors by it)."""

    # config.json model_type -> the architecture it stands for: every architecture the family
    # reads, and the one a config.json naming none (only its model_type) is read as
    model_types: dict[str, str]
    config_from_hf: Callable[[dict, str, str], Any]  # (config.json, where, remat) -> config
    config_to_hf: Callable[[Any, str, int], dict]  # (config, dtype name, max positions) -> dict
    tensors: tuple[Rule, ...]  # (spmd param path, HF tensor name, in_dims): models/hf_tensors

    @property
    def architectures(self) -> tuple[str, ...]:
        """The config.json `architectures` this family reads (its model types' ones)."""
        return tuple(self.model_types.values())


@dataclasses.dataclass(frozen=True)
class Decoder:
    """Generation with a key/value cache (models/llama_decode.py's form): the cache of
    [layers, batch, length, kv_heads, head_dim] keys and values, and one forward pass that
    writes a call's keys and values at their positions and attends over the cache."""

    # (cfg, batch, length, dtype) -> {"k", "v"} zeroed
    init_cache: Callable[[Any, int, int, Any], dict[str, jax.Array]]
    # (model, tokens [b, T], positions [b, T], cache) -> (fp32 logits [b, T, vocab], cache)
    forward: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


# The decoder of every family whose blocks have `decode` (models/llama_decode.py)
LLAMA_DECODER = Decoder(init_cache=llama_decode.init_cache, forward=llama_decode.forward)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family. Counts are parameters (scalars). What a record leaves out is the
    llama's (models/llama.py's model and losses, models/llama_decode.py's cache, every dense
    LoRA target of models/lora.py): a family states its name, config, checks and Hugging Face
    mapping, and only what else differs from a Llama."""

    name: str
    config: type  # the config dataclass (ModelConfig): the run's [model] section
    check: Callable[[Any], None]  # (cfg): UsageError if it cannot be built (before device work)
    check_layout: Callable[[Any, Any, str], None]  # (cfg, mesh, executor): UsageError if refused
    hf: HFMapping | None = None  # None: no Hugging Face architecture
    # (cfg, seed, dtype) -> a freshly initialised model (models.layers.creator of its class)
    create: Callable[..., CausalLM] = llama.create
    loss: Callable[[Any, dict], jax.Array] = llama.lm_loss  # (model, batch) -> scalar loss (fp32)
    # a pipeline's last-stage loss: (logits, targets[, weights]) -> mean loss (fp32)
    logits_loss: Callable[..., jax.Array] = llama.logits_loss
    # (model, batch) -> per-target cross-entropy, fp32 [batch, length] (preference objectives)
    token_losses: Callable[[Any, dict], jax.Array] = llama.lm_token_losses
    decoder: Decoder = LLAMA_DECODER
    step_metrics: Callable[[Any, dict], dict] | None = None  # (model, batch) -> logged figures
    # LoRA (models/lora.py): target name (peft's short form: q, k, v, o, gate, up, down) -> the
    # param paths it adapts (several: one fused projection sharing the adapter's A); empty: the
    # family offers no LoRA
    lora_targets: dict[str, tuple[tuple[str, ...], ...]] = dataclasses.field(
        default_factory=lambda: lora.DENSE
    )
    # the targets --lora-targets "" picks (empty: every one of lora_targets; peft's default for
    # Llama-shaped models is q_proj and v_proj, but the usual recipes, QLoRA's, adapt them all)
    lora_default: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.lora_default:  # frozen: the one field a family's record derives
            object.__setattr__(self, "lora_default", tuple(self.lora_targets))

    def shape(self, cfg: ModelConfig) -> ModelShape:
        """The sizes spmd.estimate reads."""
        return cfg.shape()

    def n_params(self, cfg: ModelConfig) -> int:
        """Parameters of the model (every expert included): its shape's count."""
        return cfg.shape().n_params()
