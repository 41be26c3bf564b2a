"""A run's config, resolved in one place: what spmd.train, spmd.bench and spmd.plan call to turn a
command line into the sections they run or plan. Flags, the --config TOML and the --model preset
(spmd.run.config.resolve, with --layout expanded), then the sources the run names: Hub ids
resolved to local folders, the model of --init-from-hf's config.json (its architecture, the
router knobs given winning over it), and --init-from-peft's base and [lora] section."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from models import family, finetune
from spmd.errors import UsageError
from spmd.io import hub
from spmd.run import config
from spmd.run.section_views import model_section
from spmd.sections import Config, LoraConfig, RunConfig, flag_name

# MoE training knobs that --init-from-hf takes from the flags when given (config.json has none)
ROUTER_KNOBS = ("capacity_factor", "aux_loss_coef", "aux_loss_scope", "z_loss_coef")


def sections() -> dict[str, type]:
    """A training run's sections: the model's flags (every registered family's config fields;
    the section is built as the config of the family the preset or --family names) and
    spmd.sections'."""
    return {"model": model_section(), **config.SECTIONS}


def expand_layout(values: dict[str, Any]) -> dict[str, Any]:
    """A named --layout fills --mesh, --zero (and --sequence-parallel) where not given."""
    if not values.get("layout"):
        return values
    import meshes

    preset = meshes.get(values["layout"])
    sp = {"sequence_parallel": True} if preset.sequence_parallel else {}
    return {"mesh": preset.mesh, "zero": preset.zero, **sp, **values}


def run_config(
    argv: list[str] | None,
    prog: str,
    table: dict[str, type] | None = None,
    *,
    weights: bool = True,
    check: Callable[[dict[str, Any]], None] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """The resolved config tree of a command line that runs or plans a training run
    (spmd.run.config.resolve's result: the sections, "given", and what `kwargs` ask for, such as
    `printable` or `defaults`) with its sources applied (with_sources): with --init-from-hf the
    Hugging Face folder's config.json is the architecture, and the router knobs given win over
    it; with --init-from-peft the adapter's config names the base and fills the [lora] section.
    `table`: the command's sections (default: a training run's, `sections()`); `weights` as
    with_sources's (False: the planner, which reads config.json alone); `check`: the command's
    own check of the flags, run before any folder or Hub id is read."""
    resolved = config.resolve(
        argv, sections() if table is None else table, prog, expand=expand_layout, **kwargs
    )
    if check is not None:
        check(resolved)
    return with_sources(resolved, weights)


def steps_from_epochs(resolved: dict[str, Any]) -> dict[str, Any]:
    """`resolved` with --steps 0 where --epochs says how long to train (spmd.train computes
    the steps once the data is read; a config.toml written then holds steps = 0 and reads
    back the same). UsageError where --steps was given too, other than 0."""
    run = resolved["run"]
    if run.epochs <= 0:  # (a negative count is check_counts' to refuse)
        return resolved
    if "steps" in resolved["given"] and run.steps:
        raise UsageError(
            f"--epochs {run.epochs} and --steps {run.steps} both say how long to train; give "
            f"one of them (--epochs computes the steps from the data's windows)"
        )
    return {**resolved, "run": dataclasses.replace(run, steps=0)}


def with_optimizer_defaults(resolved: dict[str, Any]) -> dict[str, Any]:
    """`resolved` with the chosen optimizer's own defaults (its entry's `defaults`) in the
    optimizer section's fields the user did not give: --optimizer schedule-free-adamw alone
    trains on a constant LR, where the section's default schedule decays."""
    from spmd.engine import optimizers

    section = resolved["optimizer"]
    own = {
        field: value
        for field, value in optimizers.get(section.optimizer).defaults
        if field not in resolved["given"]
    }
    return {**resolved, "optimizer": dataclasses.replace(section, **own)} if own else resolved


def with_epochs(cfg: Config, windows: Any) -> Config:
    """The run's Config (`cfg`) with the --steps that --epochs makes of its `windows` (read as
    one stream of epochs from now on, spmd.io.epochs), printed; `cfg` itself without --epochs.
    UsageError for what must fit in those steps (spmd.run.checks.check_steps)."""
    from spmd.io import epochs
    from spmd.log import say
    from spmd.run.checks import check_steps

    run = cfg.run
    if not run.epochs:
        return cfg
    epochs.stream_epochs(windows)
    passes = epochs.passes(windows, run.batch)
    steps = passes.steps_for(run.epochs)
    extra = steps * passes.per_step - run.epochs * passes.total
    say(
        f"--epochs {run.epochs}: {steps} steps of {passes.per_step} of the {passes.total} "
        f"{passes.what} (ceil({run.epochs} x {passes.total} / {passes.per_step}))"
        + (f"; the last step reads {extra} of epoch {run.epochs + 1}" if extra else "")
    )
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(run, steps=steps))
    check_steps(cfg)
    return cfg


def with_sources(resolved: dict[str, Any], weights: bool = True) -> dict[str, Any]:
    """`resolved` (spmd.run.config.resolve's result) with the model of --init-from-hf (or of
    --init-from-peft's base) and the [lora] section of --init-from-peft; `weights` True also
    resolves every Hub id (--init-from-hf, --tokenizer, ...) to its local folder or file.
    `weights` False (spmd.plan) reads the base's config.json alone, downloading nothing else of
    a Hub id, and leaves the flags' values as given (a Hub id stays an id)."""
    adapter = None
    if resolved["run"].init_from_peft:
        adapter = finetune.read_peft(resolved["run"].init_from_peft)
        resolved["run"] = peft_base(resolved["run"], adapter)
    if weights:
        resolved = hub.resolve_names(resolved)  # Hub ids in --init-from-hf, --tokenizer: folders
    base = resolved["run"].init_from_hf
    if base:
        remat = resolved["model"].remat
        if weights:
            model = family.open_hf(base, remat).config
        else:
            model = family.hf_model_config(hub.config_folder(base, "--init-from-hf"), remat)
        given = [name for name in ROUTER_KNOBS if name in resolved["given"]]
        knobs = {
            name: getattr(resolved["model"], name)
            for name in given
            if name in {f.name for f in dataclasses.fields(model)}
        }
        resolved["model"] = dataclasses.replace(model, **knobs)
    if adapter is not None:
        resolved["lora"] = peft_lora(resolved, adapter)
    return resolved


def peft_base(run: RunConfig, adapter: finetune.PeftAdapter) -> RunConfig:
    """The run section with the base of --init-from-peft's adapter as --init-from-hf: the
    folder or Hub id its base_model_name_or_path names (a relative path read from the current
    directory, as peft reads it), unless --init-from-hf names the base itself."""
    if run.init_from_hf:
        return run
    where = f"--init-from-peft {adapter.folder}"
    if not adapter.base:
        raise UsageError(
            f"{where}: its adapter_config.json names no base model; give it with --init-from-hf"
        )
    if not Path(adapter.base).is_dir() and not hub.is_repo_id(adapter.base):
        raise UsageError(
            f"{where}: its base_model_name_or_path {adapter.base!r} is neither a folder here "
            f"nor a Hub id; give the base with --init-from-hf"
        )
    return dataclasses.replace(run, init_from_hf=adapter.base)


def peft_lora(resolved: dict[str, Any], adapter: finetune.PeftAdapter) -> LoraConfig:
    """The [lora] section of a run continuing peft `adapter`: its r, lora_alpha and
    target_modules (as the base's family names them), and its lora_dropout unless
    --lora-dropout is given (dropout is a training choice, not part of the adapter's weights).
    UsageError naming both values for a --lora-rank/-alpha/-targets given (or a config file's
    value) that says otherwise."""
    lora, given = resolved["lora"], resolved["given"]
    targets = finetune.peft_targets(adapter, resolved["model"])
    dropout = lora.lora_dropout if "lora_dropout" in given else adapter.dropout
    read = {
        "lora_rank": (adapter.rank, "r", adapter.rank),
        "lora_alpha": (adapter.alpha, "lora_alpha", adapter.alpha),
        "lora_dropout": (dropout, "lora_dropout", dropout),
        "lora_targets": (targets, "target_modules", f"{', '.join(adapter.modules)} ({targets})"),
    }
    for field, (value, key, shown) in read.items():
        if field in given and not _agrees(field, getattr(lora, field), value, adapter.rank):
            raise UsageError(
                f"{flag_name(field)} {getattr(lora, field)} disagrees with {key} = {shown} in "
                f"{Path(adapter.folder) / 'adapter_config.json'}; leave the flag out"
            )
    return dataclasses.replace(lora, **{field: value for field, (value, *_) in read.items()})


def _agrees(field: str, flag: Any, value: Any, rank: int) -> bool:
    """Whether a --lora-* value given says what the adapter's `value` does (alpha 0: 2 x rank;
    targets: the same names in any order)."""
    if field == "lora_alpha":
        return (flag or 2.0 * rank) == value
    if field == "lora_targets":
        return {n.strip() for n in flag.split(",") if n.strip()} == set(value.split(","))
    return flag == value
