"""Adapter-only checkpoints of a LoRA run: the adapters, their optimizer state and a reference
to the frozen base, not the base itself.

A LoRA run started from `--init-from-hf` trains a few MB of adapters on a base of GBs that it
never changes. Its checkpoints hold the trainable part of the state only (the `frozen` subtree
of the params is dropped: spmd.engine.frozen), and its saved config names the base under
`lora_base`: {"base": the --init-from-hf folder (a Hub id's download) as an absolute path,
"sha256": its content hash}; absolute so that the checkpoint is read alike from any folder
(spmd.io.run_paths, which also reads an older checkpoint's relative one). A resume (or a
rollback, or `spmd.convert` / `spmd.generate` of the checkpoint) reloads the base from the
folder after checking its hash, and joins it to the restored adapters: the state is the one
a checkpoint of the whole state would give back, bit for bit, since the base is the folder's
weights cast as the run cast them. A base whose hash differs (another folder, or the same
folder with changed weights) is a UsageError naming both hashes. A base that was moved is
named to the readers with `--lora-base` (to a resume with `--init-from-hf`): the hash, not
the path, says whether it is the base.

The content hash is SHA-256 over every `*.safetensors` file of the folder, in name order, each
preceded by its name and size, every byte read (streamed in 8 MiB chunks). Every byte, because
a sample or the headers alone would miss a fine-tuned copy of the same shapes (the usual wrong
base, the one that matters); SHA-256 rather than spmd.io.manifest's faster CRC-32 because the
hash names a base across machines and copies, not one folder's accidental damage. At about 0.6
GB/s on one core a 1B model's 2.5 GB (bf16) takes 4 s, once per start, resume and save.

A LoRA run without `--init-from-hf` (a base drawn from the seed) keeps the whole state in its
checkpoints as any run does: there is no folder to refer to.

Whatever its kind, a checkpoint's [lora] section must be the resuming run's (`check_settings`):
the rank and targets fix the adapters' shapes, and alpha their scale, so an adapter trained at
alpha 8 means another function at alpha 64. As a model flag that changes a param's shape is
refused on resume (spmd.io.checkpoint_shapes), so is any of these, in one line that names the
flags to pass; only the dropout, a training choice, may change (resume notes it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from models import family, finetune
from spmd import sections
from spmd.engine import frozen
from spmd.errors import UsageError
from spmd.io import run_paths, templates

if TYPE_CHECKING:
    from models.contract import ModelConfig
    from spmd.engine.diloco import AnyProgram
    from spmd.sections import Config

KEY = "lora_base"  # the saved config's key of the base reference
_CHUNK = 8 << 20
_HASHES: dict[tuple, str] = {}  # (folder, its files' names, sizes, mtimes) -> hash


def adapter_only(cfg: Config) -> bool:
    """Whether run `cfg` checkpoints its adapters alone: LoRA onto an --init-from-hf base."""
    return cfg.lora.lora_rank > 0 and bool(cfg.run.init_from_hf)


def content_hash(folder: str | Path) -> str:
    """The SHA-256 (64 hex digits) of a Hugging Face folder's safetensors files (the module
    docstring); remembered while the files' sizes and modification times stay the same."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UsageError(f"{folder} holds no .safetensors file to identify a LoRA base by")
    stats = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    key = (str(Path(folder).resolve()), stats)
    if key not in _HASHES:
        digest = hashlib.sha256()
        for path, (name, size, _) in zip(files, stats, strict=True):
            digest.update(f"{name}\0{size}\0".encode())
            with path.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def reference(base: str) -> dict[str, str]:
    """The saved reference of base folder (or Hub id, resolved to its download) `base`: its
    absolute path and content hash."""
    return {"base": run_paths.absolute(base), "sha256": content_hash(family.open_hf(base).path)}


def config_record(cfg: Config) -> dict[str, Any]:
    """The config a checkpoint of run `cfg` saves: its sections, its tokenizer's absolute path
    (spmd.io.run_paths), and the base reference when it checkpoints adapters only."""
    record: dict[str, Any] = cfg.as_dict()
    if cfg.data.tokenizer:
        record[run_paths.TOKENIZER_KEY] = run_paths.absolute(cfg.data.tokenizer)
    if cfg.data.chat_template:  # its text: export and resume need no file (spmd.io.templates)
        record[templates.SAVED_KEY] = templates.source(cfg.data.chat_template)
    if adapter_only(cfg):
        record[KEY] = reference(cfg.run.init_from_hf)
    return record


def saved_state(cfg: Config, view: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint of run `cfg` holds of a checkpoint view: all of it, or without the
    frozen base (or DPO's reference copy, spmd.dpo_reference: the flag names it)."""
    from spmd import dpo_reference

    if dpo_reference.wanted(cfg):
        return {**view, "params": frozen.trainable(view["params"])}
    if not adapter_only(cfg):
        return view
    held = [key for key in ("params", "eval_params") if key in view]  # eval: schedule-free's
    stripped: dict[str, Any] = {key: frozen.trainable(view[key]) for key in held}
    return {**view, **stripped}


def restore_target(cfg: Config, program: AnyProgram) -> dict[str, Any]:
    """The restore target of run `cfg`'s checkpoints on `program`'s mesh."""
    return saved_state(cfg, program.abstract_checkpoint())


class BaseMissing(UsageError):
    """The base an adapter-only checkpoint refers to is not where it was recorded (nor where
    the reader's flag names it): the checkpoint itself may be whole."""


def recorded_base(
    saved: dict[str, Any], given: str, directory: str, run_config: dict[str, Any], flag: str
) -> str:
    """Where to read the base of reference `saved` (from checkpoint folder `directory`, whose
    saved config is `run_config`): `given` (the reader's `flag`, for a moved base) else the
    recorded folder (spmd.io.run_paths); BaseMissing naming `flag` when it is not a folder."""
    base = given or run_paths.resolve(str(saved.get("base", "")), directory, run_config)
    if not Path(base).is_dir():
        named = f"{flag} {given}" if given else f"the recorded LoRA base {saved.get('base')}"
        raise BaseMissing(
            f"{directory}: {named} is not a folder here; its adapters need the base they were "
            f"trained on (sha256 {str(saved.get('sha256'))[:16]}): name where it is now with "
            f"{flag} DIR"
        )
    return base


def check_base(saved: dict[str, Any], base: str, where: str, flag: str) -> str:
    """The folder of base `base` after checking it is the one of saved reference `saved`;
    UsageError naming both hashes when its weights differ, and the reader's `flag` that
    names the base."""
    folder = family.open_hf(base).path
    found = content_hash(folder)
    if found != saved.get("sha256"):
        raise UsageError(
            f"{where}: the LoRA base {base} (sha256 {found[:16]}) is not the base its adapters "
            f"were trained on ({saved.get('base')}, sha256 {str(saved.get('sha256'))[:16]}); "
            f"give that base with {flag}"
        )
    return str(folder)


def load_base(
    saved: dict[str, Any], base: str, abstract: Any, names: Any, where: str, flag: str
) -> Any:
    """The frozen base of the checkpoint whose reference is `saved`, read from `base` (after
    checking its hash) onto the dtypes and shardings of `abstract`'s frozen part (`read_base`;
    `names`: the program's logical names)."""
    folder = check_base(saved, base, where, flag)
    return read_base(family.open_hf(folder), abstract, names)


def read_base(checkpoint: Any, abstract: Any, names: Any) -> Any:
    """The frozen part of `abstract` (a LoRA program's params or master weights, and their
    logical `names`) read from Hugging Face folder `checkpoint` (family.open_hf's). A QLoRA
    base is loaded onto its weights' own shapes in fp32, then quantized to NF4 (or int8) in
    the program's shardings (models/nf4.py): the codes a base drawn from the seed would get."""
    target, named = abstract[frozen.FROZEN], names[frozen.FROZEN]
    plain = finetune.unquantized(target, named, jnp.float32)
    base = family.load_hf(checkpoint, plain)
    if len(jax.tree.leaves(plain)) == len(jax.tree.leaves(target)):
        return base  # nothing quantized (a quantized weight has a scales leaf beside it)
    shardings = jax.tree.map(lambda s: s.sharding, target)
    quantize = jax.jit(lambda b: finetune.quantized_like(b, named, target), out_shardings=shardings)
    return quantize(base)


def with_base(cfg: Config, program: AnyProgram, restored: Any) -> dict[str, Any]:
    """The restored checkpoint's state with its base joined back (what `program.
    from_checkpoint` takes); as restored for a run that checkpoints the whole state. DPO's
    reference copy is read from its flag again (spmd.dpo_reference)."""
    from spmd import dpo_reference

    if dpo_reference.wanted(cfg):
        return dpo_reference.joined(cfg, program, restored.state)
    if not adapter_only(cfg):
        return restored.state
    saved = restored.config.get(KEY)
    if not isinstance(saved, dict):
        raise UsageError(
            f"--checkpoint-dir {cfg.checkpoint.checkpoint_dir} step {restored.step} holds no "
            f"LoRA base reference (a checkpoint of another kind of run); resume it with the "
            f"flags it was saved with"
        )
    where = f"--checkpoint-dir {cfg.checkpoint.checkpoint_dir} step {restored.step}"
    flag, given = "--init-from-hf", cfg.run.init_from_hf
    base = load_base(saved, given, program.abstract_master, program.names, where, flag)
    state = dict(restored.state)
    state["params"] = frozen.join(state["params"], base)
    return state


def planner_fields(model_cfg: ModelConfig, lora_cfg: Any) -> dict[str, Any]:
    """The Setup fields (lora_rank, lora_targets, lora_base_dtype) of a run's [lora] section
    for its model's family (its default targets when none are named); UsageError for bad
    flags."""
    spec = finetune.lora_spec(
        family.of(model_cfg),
        lora_cfg.lora_rank,
        lora_cfg.lora_alpha,
        lora_cfg.lora_dropout,
        lora_cfg.lora_targets,
        lora_cfg.lora_base_dtype,
    )
    if spec is None:
        return {"lora_rank": 0, "lora_targets": ()}
    targets = tuple(spec.targets)
    return {"lora_rank": spec.rank, "lora_targets": targets, "lora_base_dtype": spec.base_dtype}


def check_settings(cfg: Config, saved_config: dict[str, Any], where: str) -> None:
    """UsageError unless the LoRA adapters a checkpoint holds (its saved config's [lora]
    section: none, or their rank, alpha and targets) are those run `cfg` trains; the line
    names what differs and the flags that resume the checkpoint. `where` names the checkpoint
    (its step and folder)."""
    saved = sections.flat_values(saved_config)
    fam = family.of(cfg.model)
    rank = int(saved.get("lora_rank", 0) or 0)  # a checkpoint from before LoRA: none
    lora = cfg.lora
    ours = _settings(fam, lora.lora_rank, lora.lora_alpha, lora.lora_targets, lora.lora_base_dtype)
    if rank == 0:
        if ours is not None:
            raise UsageError(
                f"{where} holds a run without LoRA (every param trained), not this run's "
                f"--lora-rank {cfg.lora.lora_rank}; resume it without the --lora-* flags"
            )
        return
    try:
        alpha, targets = saved.get("lora_alpha", 0.0), saved.get("lora_targets", "")
        theirs = _settings(fam, rank, alpha, targets, saved.get("lora_base_dtype", ""))
    except UsageError:  # saved by another family's run: the model's own check names it
        return
    if theirs == ours:
        return
    assert theirs is not None
    flags = f"--lora-rank {rank} --lora-alpha {_number(theirs[1])}"
    if set(theirs[2]) != set(fam.lora_default):
        flags += f" --lora-targets {','.join(theirs[2])}"
    if theirs[3]:
        flags += f" --lora-base-dtype {theirs[3]}"
    this = "this run has none (no --lora-rank)" if ours is None else f"this run's are {_text(ours)}"
    raise UsageError(
        f"{where} holds LoRA adapters of {_text(theirs)}; {this}; resume it with {flags}"
    )


def _settings(fam: Any, rank: int, alpha: float, targets: str, base_dtype: str) -> tuple | None:
    """(rank, alpha, target names in the family's order, the base's storage) of the --lora-*
    values, alpha 0 read as 2 x rank and no targets as the family's default; None at rank 0."""
    spec = finetune.lora_spec(fam, rank, alpha, 0.0, targets, base_dtype)
    if spec is None:
        return None
    names = tuple(name for name in fam.lora_targets if name in spec.targets)
    return spec.rank, spec.alpha, names, spec.base_dtype


def _text(settings: tuple) -> str:
    rank, alpha, targets, base_dtype = settings
    scale = f"scale {alpha / rank:g}"
    base = f", an {base_dtype} base" if base_dtype else ""
    return f"rank {rank}, alpha {_number(alpha)} ({scale}), targets {','.join(targets)}{base}"


def _number(value: float) -> str:
    """`value` short (8, not 8.0) where that reads back as the same float, else in full: the
    flag a message names must resume the checkpoint."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)
