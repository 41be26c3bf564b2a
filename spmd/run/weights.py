"""Where the params of `spmd.generate` and `spmd.convert` come from: an spmd checkpoint folder
or a Hugging Face folder, loaded straight onto the shardings of a mesh.

Both build the same Program as training (spmd.run.builder) for the model the source
describes, so params land in exactly the layout a training run of that mesh would use.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from models import family, finetune
from spmd import dpo_reference, lora_base
from spmd.engine import frozen
from spmd.engine.step import Program
from spmd.errors import UsageError
from spmd.io import params_io
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import setup_mesh
from spmd.run import builder
from spmd.sections import LoraConfig

if TYPE_CHECKING:
    from models.contract import ModelConfig
    from spmd.engine.diloco import AnyProgram
    from spmd.sections import Config


@dataclasses.dataclass
class Loaded:
    """Params on a mesh and what describes them."""

    model: Any  # the family's config
    program: Program
    params: Any
    run_config: dict[str, Any]  # the config saved with the checkpoint ({} for HF folders)
    source: str  # for people: where the params came from
    # a LoRA checkpoint's adapters (host arrays) and their spec; `params` are then the merged
    # model's (base + scale * A @ B)
    adapters: Any = None
    lora: Any = None  # finetune.LoraSpec
    base: str = ""  # the folder an adapter-only LoRA checkpoint's base was read from


def setup_layout(mesh: str, devices: int, zero: int) -> Layout:
    """The mesh of `--mesh` (simulating CPU devices when needed, so call this before anything
    starts JAX's backend) and the ZeRO stage that decides how params are sharded."""

    return Layout(setup_mesh(mesh, devices), zero)


def model_program(cfg: ModelConfig, layout: Layout) -> Program:
    """The Program of model `cfg` (its family's) on `layout`, for its
    param shardings and forward pass (no training: the optimizer is the identity, which has no
    state); spmd.run.builder's, as training builds it."""
    return builder.model_program(cfg, layout)


def from_checkpoint(directory: str, step: int, layout: Layout, base: str = "") -> Loaded:
    """The params of checkpoint `step` (0: newest) of an spmd checkpoint folder; an
    adapter-only LoRA checkpoint's base is read from `base` (--lora-base) when given, else
    from where the checkpoint recorded it. UsageError for `base` given to another kind of
    checkpoint."""
    step = params_io.pick_step(directory, step)
    params_io.verify_step(directory, step)
    run_config = params_io.saved_config(directory, step)
    cfg = family.config_from_dict(run_config.get("model", {}))
    program = model_program(cfg, layout)
    source = f"{directory} step {step}"
    adapters = builder.lora_spec(cfg, LoraConfig(**run_config.get("lora", {})))
    if base and not isinstance(run_config.get(lora_base.KEY), dict):
        raise UsageError(
            f"--lora-base {base}: {source} is not an adapter-only LoRA checkpoint (a LoRA run "
            f"from --init-from-hf), so it reads no base; leave --lora-base out"
        )
    if adapters is None:
        params = params_io.restore_params(directory, step, program.abstract_params)
        return Loaded(cfg, program, params, run_config, source)
    lora_program = builder.model_program(cfg, layout, adapters)
    saved = run_config.get(lora_base.KEY)
    if isinstance(saved, dict):
        base = lora_base.recorded_base(saved, base, directory, run_config, "--lora-base")
    params = lora_params(directory, step, lora_program, run_config, base)
    merged = merge_lora(lora_program, program, params)
    host = jax.device_get(frozen.trainable(params)["lora"])
    return Loaded(cfg, program, merged, run_config, source, host, adapters, base)


def lora_params(
    directory: str, step: int, program: Program, run_config: dict[str, Any], given: str = ""
) -> Any:
    """The params of a LoRA run's checkpoint on `program`: as saved, or (an adapter-only
    checkpoint, spmd.lora_base) the adapters joined to the base reloaded from `given`
    (--lora-base) or the folder the checkpoint names, after checking its hash."""
    saved = run_config.get(lora_base.KEY)
    if not isinstance(saved, dict):
        return params_io.restore_params(directory, step, program.abstract_params)
    folder = lora_base.recorded_base(saved, given, directory, run_config, "--lora-base")
    adapters = frozen.trainable(program.abstract_params)
    trained = params_io.restore_params(directory, step, adapters)
    where = f"{directory} step {step}"
    abstract, names = program.abstract_params, program.names
    base = lora_base.load_base(saved, folder, abstract, names, where, "--lora-base")
    return frozen.join(trained, base)


def merge_lora(lora_program: Program, program: Program, params: Any) -> Any:
    """The params of `program` (the base model) holding LoRA model `params` merged once:
    every target's W + scale * A @ B, on the base program's shardings."""
    shardings = jax.tree.map(lambda s: s.sharding, program.abstract_params)

    def merged(p: Any) -> Any:
        model: Any = lora_program.model(p)  # a models.lora.LoraModel
        return nnx.to_pure_dict(nnx.state(model.merged()))

    return jax.jit(merged, out_shardings=shardings)(params)


# The key of a converted checkpoint's config that keeps config.json's max_position_embeddings
MAX_POSITIONS = "max_positions"


@dataclasses.dataclass(frozen=True)
class Source:
    """What a checkpoint or Hugging Face folder holds, read without a param: the model, the
    saved run config, and the longest sequence it declares (None: none declared)."""

    model: Any  # the family's config
    run_config: dict[str, Any]
    max_positions: int | None
    where: str  # for people: what declares max_positions


def describe(checkpoint: str, step: int, from_hf: str) -> Source:
    """The Source of `--checkpoint` (its `step`, 0: newest) or `--from-hf`. A Hugging Face
    folder declares max_position_embeddings, and a converted checkpoint keeps it; a training
    run's checkpoint declares none (RoPE has no hard maximum; its --seq-len is only the window
    it trained on). Reading a checkpoint's config starts JAX's backend (orbax): call this after
    setup_layout."""
    if checkpoint:
        step = params_io.pick_step(checkpoint, step)
        run_config = params_io.saved_config(checkpoint, step)
        model = family.config_from_dict(run_config.get("model", {}))
        declared = run_config.get(MAX_POSITIONS)
        where = f"max_position_embeddings of the config.json {checkpoint} was converted from"
        return Source(model, run_config, declared if isinstance(declared, int) else None, where)
    folder = family.open_hf(from_hf)
    declared = folder.raw_config.get("max_position_embeddings")
    where = f"max_position_embeddings in {folder.path / 'config.json'}"
    return Source(folder.config, {}, declared, where)


def init_from_hf(
    directory: str, program: AnyProgram, peft: str = "", adapters: Any = None
) -> tuple[Any, Any, Any]:
    """(params, optimizer state, loss scale) to start training `program` from a Hugging Face
    folder: its weights, read in fp32 as the master weights, with a fresh optimizer state (the
    working params derived in the policy's dtype). A LoRA program's adapters start fresh, or
    from peft folder `peft` (--init-from-peft) holding adapters of spec `adapters`."""
    checkpoint = family.open_hf(directory)
    if not frozen.has_frozen(program.abstract_master):
        return tuple(program.start(family.load_hf(checkpoint, program.abstract_master)))
    # LoRA: the folder is the frozen base; the adapters start fresh (A random, B zero)
    base = lora_base.read_base(checkpoint, program.abstract_master, program.names)
    if peft:
        like = frozen.trainable(program.abstract_master)
        host = {"lora": finetune.load_peft(peft, adapters, checkpoint.config, like["lora"])}
        trained = jax.tree.map(
            lambda x, t: jax.make_array_from_callback(x.shape, t.sharding, lambda i: x[i]),
            host,
            like,
        )
        return tuple(program.start(frozen.join(trained, base)))
    fresh = frozen.trainable(program.checkpoint_view(program.init())["params"])
    return tuple(program.start(frozen.join(fresh, base)))


def initial(cfg: Config, program: AnyProgram) -> tuple[Any, Any, Any]:
    """(params, optimizer state, loss scale) a fresh run `cfg` starts from: DPO's reference
    copy read with the policy (spmd.dpo_reference), --init-from-hf's weights (and
    --init-from-peft's adapters), or the seed's init."""
    if dpo_reference.wanted(cfg):
        return dpo_reference.initial(cfg, program)
    if cfg.run.init_from_hf:
        adapters = builder.lora_spec(cfg.model, cfg.lora)  # --init-from-peft's adapters
        return init_from_hf(cfg.run.init_from_hf, program, cfg.run.init_from_peft, adapters)
    return tuple(program.init())


def from_hf(directory: str, layout: Layout) -> Loaded:
    """The params of a Hugging Face folder (config.json + safetensors) of any architecture a
    registered family reads."""
    checkpoint = family.open_hf(directory)
    program = model_program(checkpoint.config, layout)
    params = family.load_hf(checkpoint, program.abstract_params)
    return Loaded(checkpoint.config, program, params, {}, directory)
