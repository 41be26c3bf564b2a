"""What the commands that build a training run share (spmd.train, spmd.bench), so that no command
imports another: the lines that describe a built Program and the echo of the config's values that
differ from the defaults. (Their config is resolved by spmd.run.resolve.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from models import family
from spmd.engine import fp8_setup, precision
from spmd.log import say
from spmd.parallel.mesh import format_mesh
from spmd.run import builder, config
from spmd.run.checks import batch_arithmetic, format_batch_arithmetic
from spmd.run.config import Config

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyProgram
    from spmd.observe.metrics import MetricsLog


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
        spec = builder.run_model(cfg)  # the model the run trains, its objective's loss included
        matmuls = fp8_setup.block_matmuls(spec.make, spec.loss, policy.fp8)
        say(precision.describe(policy, matmuls))
        device = fp8_setup.device_line(mesh, policy.fp8, matmuls)
        if device is not None:
            say(device)
    if cfg.optimizer.optimizer == "muon":  # which params Muon updates, which AdamW
        from spmd.engine import frozen, muon

        names, shapes = frozen.trainable(program.names), frozen.trainable(program.abstract_params)
        say(muon.describe(names, shapes))
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


def watchers(
    cfg: Config, program: AnyProgram, folder: str | None, log: MetricsLog, harness_tasks: Any
) -> tuple[Any, Any]:
    """(sampler, harness evaluator) of a run: what --sample-every and --eval-harness-every run
    on the training params between steps (None where off). Both feed the model alone on the
    run's layout, which DiLoCo, pipelines and LoRA are refused (spmd.run.samples.not_yet)."""
    from spmd.engine.step import Program
    from spmd.io import run_data
    from spmd.run import samples

    sampler = harness_eval = None
    if folder and cfg.observe.sample_every:
        assert isinstance(program, Program)
        model = builder.model_program(cfg.model, program.layout)
        fields = run_data.first_source_fields(cfg.data)
        sampler = samples.Sampler(cfg, program, model, folder, log, fields)
    if harness_tasks is not None:
        from spmd.run.lm_eval_bridge import training_evaluator

        assert isinstance(program, Program)
        rows = (cfg.run.seq_len, cfg.run.batch)
        harness_eval = training_evaluator(cfg.data, harness_tasks, program, rows, log)
    return sampler, harness_eval
