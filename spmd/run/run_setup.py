"""What the commands that resolve, build or plan a training run share (spmd.train, spmd.bench,
spmd.plan), so that no command imports another: the run's sections with the model families'
flags, --layout's expansion, the resolution of --init-from-hf and --init-from-peft, and the
lines that describe a built Program."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from models import family, finetune
from spmd.engine import fp8_setup, precision
from spmd.errors import UsageError
from spmd.io import hub
from spmd.log import say
from spmd.parallel.mesh import format_mesh
from spmd.run import builder, config
from spmd.run.checks import batch_arithmetic, format_batch_arithmetic
from spmd.run.config import Config
from spmd.run.section_views import model_section
from spmd.sections import LoraConfig, RunConfig, flag_name

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyProgram

# MoE training knobs that --init-from-hf takes from the flags when given (config.json has none)
ROUTER_KNOBS = ("capacity_factor", "aux_loss_coef", "z_loss_coef")


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


def resolve_run(argv: list[str] | None, prog: str, **kwargs: Any) -> dict[str, Any]:
    """The run's config tree of a command line (spmd.run.config.resolve's result: the sections,
    "given", and what `kwargs` ask for); with --init-from-hf the Hugging Face folder's
    config.json is the architecture, and the router knobs given win over it; with
    --init-from-peft the adapter's config names the base and fills the [lora] section."""
    resolved = config.resolve(argv, sections(), prog, expand=expand_layout, **kwargs)
    return with_sources(resolved)


def with_sources(resolved: dict[str, Any], weights: bool = True) -> dict[str, Any]:
    """`resolved` (spmd.run.config.resolve's result) with the model of --init-from-hf (or of
    --init-from-peft's base) and the [lora] section of --init-from-peft. `weights` False
    (spmd.plan) reads the base's config.json alone, downloading nothing else of a Hub id, and
    leaves the flags' values as given (a Hub id stays an id)."""
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


def describe_program(cfg: Config, program: AnyProgram) -> dict[str, Any] | None:
    """Print the mesh, the batch arithmetic, the precision policy and the pipeline schedule of
    the run's Program; returns the pipeline schedule's figures (None at pp=1)."""

    layout = program.layout
    mesh, n_params = layout.mesh, family.of(cfg.model).n_params(cfg.model)
    say(
        f"mesh {format_mesh(dict(mesh.shape))} ({mesh.size} x {jax.devices()[0].device_kind}), "
        f"zero {cfg.parallel.zero} | {n_params / 1e6:.2f} M params | "
        f"{format_batch_arithmetic(batch_arithmetic(cfg, layout.data_parallel))}"
    )
    policy = builder.policy_of(cfg)
    if policy.fp8 is None:
        say(precision.describe(policy))
    else:
        spec = builder.model_spec(cfg.model, policy, builder.lora_spec(cfg.model, cfg.lora))
        matmuls = fp8_setup.block_matmuls(spec.make, spec.loss, policy.fp8)
        say(precision.describe(policy, matmuls))
        say(fp8_setup.device_line(mesh, policy.fp8))
    report = builder.pipeline_report(cfg, layout)
    if report is not None:
        say(
            f"pipeline: {report['schedule']} over {mesh.shape['pipeline']} stages x "
            f"{report['virtual']} chunks, {report['microbatches']} micro-batches | bubble "
            f"(p-1)/(M+p-1)/v {report['bubble_theory']:.3f} | idle share of the tick table run "
            f"{report['idle_fraction']:.3f} ({report['ticks']} ticks, {report['stash_slots']} "
            f"stashed inputs per stage)"
        )
    return report


def describe_config(cfg: Config, folder: str | None) -> str:
    """What a run prints of its config: one line per section holding a value other than its
    default (the model's default: its --model preset's, or with --init-from-hf the family's
    field defaults), and where the whole config is (the run folder's config.toml, else
    --print-config)."""
    from spmd.training.run_folder import CONFIG_FILE

    whole = (
        f"the whole config: {Path(folder) / CONFIG_FILE}"
        if folder
        else "the whole config: the same command with --print-config prints it"
    )
    lines = [
        f"[{name}] " + ", ".join(f"{k} = {config.toml_value(v, k)}" for k, v in changed.items())
        for name, changed in config_changes(cfg).items()
    ]
    if not lines:
        return f"config: every value its default ({whole})"
    return "\n".join([f"config, what differs from the defaults ({whole}):", *lines])


def config_changes(cfg: Config) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of the fields whose values are not their defaults; from a
    Hugging Face folder, the model's family always (the architecture its config.json names)."""
    changes = {}
    from_hf = bool(cfg.run.init_from_hf or cfg.run.init_from_peft)
    for name, section in cfg.sections().items():
        defaults = field_defaults(type(section))
        if name == "model" and from_hf:
            defaults.pop("family", None)
        elif name == "model":
            defaults.update(config.preset(cfg.run.model))
        values = dataclasses.asdict(section)
        changed = {k: v for k, v in values.items() if k not in defaults or defaults[k] != v}
        if "family" in changed:  # the architecture first
            changed = {"family": changed.pop("family"), **changed}
        if changed:
            changes[name] = changed
    return changes


def field_defaults(cls: type) -> dict[str, Any]:
    """The default value of each of a section dataclass's fields that has one."""
    found = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            found[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            found[field.name] = field.default_factory()
    return found
