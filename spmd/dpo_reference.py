"""DPO's frozen reference copy for a full fine-tune: `--dpo-reference PATH_OR_HUB_ID`.

Under LoRA the reference is the policy's own frozen base (models/lora.py `with_reference`).
A full fine-tune trains every param, so its reference is a second model: a copy of the
policy's architecture holding the weights of an spmd checkpoint folder of a whole model (its
newest step: a full fine-tune's, or `spmd.convert --to`'s; a LoRA checkpoint is refused, to
be merged with `--to-hf` first) or a Hugging Face folder / Hub id, read straight onto the
copy's shardings by the readers `--init-from-hf` and `spmd.generate` use (models.family,
spmd.io.params_io).

The copy is attached to the policy module under the engine's `frozen` key
(spmd.engine.frozen), so the params are {the policy's own, "frozen": the reference's}: the
reference is an argument of every step, in the policy's shardings (the same logical names)
and working dtype, and gets no gradient, no optimizer state and no master copy. The loss runs
it under stop_gradient on the batch (`finetune.with_reference`, LoRA's wrapper: it reads
`model.frozen`). Checkpoints hold the policy alone (spmd.lora_base.saved_state), which is a
plain full fine-tune's checkpoint to `spmd.convert` / `spmd.generate`; a resume reads the
reference from the flag again (`joined`). A reference of another vocabulary or param shapes is
refused from its config (`check`), before anything compiles or loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from spmd.engine import frozen
from spmd.errors import UsageError

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyProgram
    from spmd.sections import Config

FLAG = "--dpo-reference"


def wanted(cfg: Config) -> bool:
    """Whether run `cfg`'s step holds a frozen reference copy (a full fine-tune's DPO; with
    --dpo-precompute-reference the copy serves only before training, spmd.reference_cache)."""
    knobs = cfg.preference
    return bool(knobs.dpo_reference) and not knobs.dpo_precompute_reference


def attach(policy: nnx.Module, reference: nnx.Module) -> nnx.Module:
    """`policy` holding `reference` (a module of the same architecture) at its `frozen` key."""
    setattr(policy, frozen.FROZEN, reference)
    return policy


def check_flags(objective: str, lora_rank: int, source: str) -> None:
    """UsageError (one line) for --dpo-reference where it has no meaning."""
    if not source:
        return
    if objective != "dpo":
        raise UsageError(
            f"{FLAG} {source} is DPO's reference model, which --objective {objective} does not "
            f"read; use --objective dpo, or leave {FLAG} out"
        )
    if lora_rank > 0:
        raise UsageError(
            f"{FLAG} {source}: a LoRA run's reference is its own frozen base (adapters off); "
            f"leave {FLAG} out, or train every param (no --lora-rank)"
        )


def _kind(source: str) -> str:
    """What `source` names: "hf" or "checkpoint" (UsageError for neither)."""
    if (Path(source) / "config.json").is_file():
        return "hf"  # a Hugging Face folder (a Hub id's download: spmd.io.hub resolved it)
    from spmd.io import checkpoint

    if checkpoint.complete_steps(source):
        return "checkpoint"
    raise UsageError(
        f"{FLAG} {source} is neither a Hugging Face folder (config.json and safetensors), a Hub "
        f"id, nor an spmd checkpoint folder with a complete step; give one of those"
    )


def check(cfg: Config) -> None:
    """UsageError (one line, naming the value and what is valid) unless run `cfg`'s
    --dpo-reference is meaningful for its objective and LoRA, and names a model of the
    policy's vocabulary and param shapes: read from its config alone, before anything
    compiles or loads."""
    source = cfg.preference.dpo_reference
    check_flags(cfg.run.objective, cfg.lora.lora_rank, source)
    if not source:
        return
    from models import family

    if _kind(source) == "hf":
        model_cfg = family.hf_model_config(source)
    else:
        model_cfg = family.config_from_dict(_saved_config(source).get("model", {}))
    theirs, ours = model_cfg.vocab_size, cfg.model.vocab_size
    if theirs != ours:
        raise UsageError(
            f"{FLAG} {source} has a vocabulary of {theirs} tokens and the policy {ours}; the "
            f"reference must be a model of the policy's vocabulary and shapes (e.g. the one "
            f"it was fine-tuned from)"
        )
    found, want = _shapes(model_cfg), _shapes(cfg.model)
    for name, shape in want.items():
        if found.get(name) != shape:
            raise UsageError(
                f"{FLAG} {source} holds {name} of shape {found.get(name)} and the policy "
                f"{shape}; the reference must be a model of the policy's family and shapes"
            )
    if len(found) != len(want):
        raise UsageError(
            f"{FLAG} {source} holds {len(found)} params and the policy {len(want)}; the "
            f"reference must be a model of the policy's family and shapes"
        )


def _saved_config(source: str) -> dict[str, Any]:
    """The run config of the newest step of spmd checkpoint folder `source`; UsageError for
    a LoRA run's (its adapters need merging into their base first)."""
    from spmd.io import params_io

    saved = params_io.saved_config(source, params_io.pick_step(source, 0))
    if int(saved.get("lora", {}).get("lora_rank", 0) or 0):
        raise UsageError(
            f"{FLAG} {source} holds a LoRA run's adapters, not a whole model; merge them first "
            f"(python -m spmd.convert --checkpoint {source} --to-hf DIR) and give {FLAG} DIR"
        )
    return saved


def _shapes(model_cfg: Any) -> dict[str, tuple[int, ...]]:
    """Each param's shape (by path) of the family model `model_cfg`, traced, none made."""
    from models import family

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: family.of(model_cfg).create(model_cfg, 0))
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    return {jax.tree_util.keystr(path): tuple(x.shape) for path, x in leaves}


def load(cfg: Config, program: AnyProgram) -> Any:
    """The reference params of run `cfg`'s --dpo-reference (`check`ed) on `program`'s frozen
    part: its master dtypes and shardings, read straight onto them."""
    return read(cfg.preference.dpo_reference, program.abstract_master[frozen.FROZEN])


def read(source: str, target: Any) -> Any:
    """The params of reference `source` (a Hugging Face folder or an spmd checkpoint folder,
    `check`ed) read straight onto `target`'s dtypes and shardings (abstract params)."""
    from models import family
    from spmd.io import params_io

    if _kind(source) == "hf":
        return family.load_hf(family.open_hf(source), target)
    step = params_io.pick_step(source, 0)
    params_io.verify_step(source, step)
    return params_io.restore_params(source, step, target)


def initial(cfg: Config, program: AnyProgram) -> tuple[Any, Any, Any]:
    """(params, optimizer state, loss scale) of a fresh run with a reference copy: the policy
    from --init-from-hf (or the seed), the reference from --dpo-reference."""
    from models import family

    reference = load(cfg, program)
    if cfg.run.init_from_hf:
        like = frozen.trainable(program.abstract_master)
        policy = family.load_hf(family.open_hf(cfg.run.init_from_hf), like)
    else:
        policy = frozen.trainable(program.checkpoint_view(program.init())["params"])
    return tuple(program.start(frozen.join(policy, reference)))


def joined(cfg: Config, program: AnyProgram, state: dict[str, Any]) -> dict[str, Any]:
    """A restored checkpoint `state` (the policy's) with the reference read again from the
    flag (`program.from_checkpoint` casts it to the working dtype)."""
    return {**state, "params": frozen.join(state["params"], load(cfg, program))}
