"""What the commands that resolve, build or plan a training run share (spmd.train, spmd.bench,
spmd.plan), so that no command imports another: the run's sections with the model families'
flags, --layout's expansion, the resolution of --init-from-hf, and the lines that describe a
built Program."""

from __future__ import annotations

import dataclasses
from typing import Any

from models import family
from spmd import builder, config
from spmd.checks import batch_arithmetic, format_batch_arithmetic
from spmd.config import Config
from spmd.engine import precision
from spmd.io import hub
from spmd.log import say
from spmd.section_views import model_section

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
    """The run's config tree of a command line (spmd.config.resolve's result: the sections,
    "given", and what `kwargs` ask for); with --init-from-hf the Hugging Face folder's
    config.json is the architecture, and the router knobs given win over it."""
    resolved = config.resolve(argv, sections(), prog, expand=expand_layout, **kwargs)
    resolved = hub.resolve_names(resolved)  # Hub ids in --init-from-hf, --tokenizer: folders
    if resolved["run"].init_from_hf:
        folder = family.open_hf(resolved["run"].init_from_hf, resolved["model"].remat)
        given = [name for name in ROUTER_KNOBS if name in resolved["given"]]
        knobs = {
            name: getattr(resolved["model"], name)
            for name in given
            if name in {f.name for f in dataclasses.fields(folder.config)}
        }
        resolved["model"] = dataclasses.replace(folder.config, **knobs)
    return resolved


def describe_program(cfg: Config, program: Any) -> dict[str, Any] | None:
    """Print the mesh, the batch arithmetic, the precision policy and the pipeline schedule of
    the run's Program; returns the pipeline schedule's figures (None at pp=1)."""
    import jax

    from spmd.parallel.mesh import format_mesh

    layout = program.layout
    mesh, n_params = layout.mesh, family.of(cfg.model).n_params(cfg.model)
    say(
        f"mesh {format_mesh(dict(mesh.shape))} ({mesh.size} x {jax.devices()[0].device_kind}), "
        f"zero {cfg.parallel.zero} | {n_params / 1e6:.2f} M params | "
        f"{format_batch_arithmetic(batch_arithmetic(cfg, layout.data_parallel))}"
    )
    policy = builder.policy_of(cfg)
    say(precision.describe(policy))
    if policy.fp8 is not None:
        from spmd.engine import fp8_setup

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
