"""`python -m spmd.plan`: will a model fit, what will a step communicate, which layout to use.

    python -m spmd.plan --params 30e9 --devices 32 --hbm 80 --recommend --plot plan.png
    python -m spmd.plan --init-from-hf meta-llama/Llama-3.1-8B --lora-rank 16 --recommend
    python -m spmd.plan --model 1b --devices 8 --zero 3 --batch 64 --seq-len 2048 [--json]
    python -m spmd.plan --model tiny --mesh dp=2,fsdp=2,tp=2 --batch 16 --seq-len 64 --measure

Prints the analytic model of spmd.estimate for one layout (or, with --recommend, for the
fastest layout that fits, searched over mesh, ZeRO stage, micro-batch and accum, remat and
pipeline schedule): memory per device by role against the HBM, the collectives of one
optimizer step with their ring times, the step time (compute + exposed communication +
bubble) and the batch arithmetic, then the runner-ups and the `python -m spmd.train` command
that runs the choice (with a learning rate for the model's size, spmd.estimate.lr_rule, where
--lr is not given). The model: a preset, a Hugging Face folder or Hub id (--init-from-hf: its
config.json alone), or --params, a current release's published shape. --plot draws memory
and step time; --measure compiles the real train step on simulated CPU devices and puts its
figures beside the analytic ones. Every flag of
`python -m spmd.train` is accepted, so a training command line can be planned as it is; what
it leaves out is planned as pretraining: bf16, sequences of 4096 tokens, about 4.2 M tokens
(2^22) per step. Units: bytes, seconds; GB = 1e9 bytes, GB/s = 1e9 bytes/s, TFLOP/s = 1e12
FLOP/s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from models import family
from spmd import lora_base
from spmd.errors import UsageError
from spmd.estimate import cost, lr_rule, measure, plot, recommend, search, summary
from spmd.estimate.shape import PARAMS_RANGE, release_for
from spmd.parallel import mesh as mesh_lib
from spmd.parallel.mesh import AXIS_ALIASES, MESH_AXES, parse_mesh, resolve_mesh
from spmd.run import builder, config, plan_flags, resolve
from spmd.run.checks import check_choices
from spmd.run.config import Config
from spmd.run.section_views import model_section
from spmd.sections import LoraConfig

if TYPE_CHECKING:
    from models.contract import ModelConfig


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def check_values(cfg: Config, plan: Any) -> None:
    """UsageError for a planner value outside its range (NaN and infinities included), and
    for any training flag spmd.train would refuse (spmd.run.checks.check_choices: a training
    command line is planned as it is, so it is checked as it is; --batch 0 is the planner's
    "about --tokens-per-step")."""

    for name in ("hbm", "bandwidth", "inter_bandwidth", "tflops", "host_bandwidth", "host_memory"):
        if not 0 < getattr(plan, name) < math.inf:
            raise UsageError(
                f"{config.flag_name(name)} {getattr(plan, name)} must be positive and finite"
            )
    for name in ("overhead", "latency"):
        if not 0 <= getattr(plan, name) < math.inf:
            raise UsageError(f"{config.flag_name(name)} {getattr(plan, name)} must be finite, >= 0")
    if plan.devices_per_node < 1:
        raise UsageError(f"--devices-per-node {plan.devices_per_node} must be positive")
    smallest, largest = PARAMS_RANGE
    if not (plan.params == 0 or smallest <= plan.params <= largest):
        raise UsageError(
            f"--params {plan.params:g} is outside the sizes the planner has a published shape "
            f"for ({smallest:.3g} to {largest:.3g} parameters); give a size in that range, or "
            f"--init-from-hf with the model's folder or Hub id, or a --model preset with shape "
            f"flags"
        )
    if not 0 <= plan.overlap <= 1:
        raise UsageError(f"--overlap {plan.overlap} must be a share between 0 and 1")
    if plan.tokens_per_step < 1:
        raise UsageError(f"--tokens-per-step {plan.tokens_per_step} must be positive")
    if cfg.run.batch < 0:
        raise UsageError(f"--batch {cfg.run.batch} must be >= 0 (0: about --tokens-per-step)")
    if cfg.parallel.zero not in (0, 1, 2, 3):
        raise UsageError(f"--zero {cfg.parallel.zero} is not a ZeRO stage; use 0 (DDP), 1, 2 or 3")
    run = dataclasses.replace(cfg.run, batch=cfg.run.batch or 1)
    # the planner's stage 0 (plain DDP) is the engine's data axis
    parallel = dataclasses.replace(cfg.parallel, zero=cfg.parallel.zero or 1)
    check_choices(dataclasses.replace(cfg, run=run, parallel=parallel))


def check_one_model(sections: dict[str, Any]) -> None:
    """UsageError for --params beside --init-from-hf or --init-from-peft (before either is read)."""
    if sections["plan"].params and (sections["run"].init_from_hf or sections["run"].init_from_peft):
        raise UsageError(
            f"--params {sections['plan'].params:g} plans a published shape of that size, and "
            f"--init-from-hf (or --init-from-peft) names the model itself; give one of them"
        )


def resolve_sections(argv: list[str]) -> dict[str, Any]:
    """The planner's config tree of a command line (spmd.run.resolve.run_config's): the model of
    --init-from-hf (--init-from-peft's base) from its config.json alone, no weights."""
    return resolve.run_config(
        argv,
        "python -m spmd.plan",
        plan_flags.sections(),
        weights=False,
        check=check_one_model,
        defaults=plan_flags.DEFAULTS,
    )


def run(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        plan_flags.help_parser(__doc__.split("\n\n")[1]).print_help()
        return 0
    sections = resolve_sections(argv)
    cfg, model_cfg, plan = Config.of(sections), sections["model"], sections["plan"]
    given = sections["given"]  # the flags and file keys given (--layout's mesh and zero too)
    if "mesh" not in given and cfg.parallel.zero == 0:  # plain DDP: every device on dp
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mesh="dp=-1"))
    plan = search.with_gpu(plan, given)
    check_values(cfg, plan)
    planned, n_params, name, model_args = model_shape(given, model_cfg, cfg, plan)
    if not cfg.run.init_from_peft:  # (a peft adapter carries its own)
        model_args = [*model_args, *lora_flags(cfg.lora)]  # the run's adapters, as asked
    shape = family.of(planned).shape(planned)
    sizes = parse_mesh(cfg.parallel.mesh)
    devices = cfg.parallel.devices or (
        plan.devices_per_node if -1 in sizes.values() else math.prod(sizes.values())
    )
    cluster = search.cluster_of(plan)
    space = search.Space(
        batch=cfg.run.batch,
        tokens=plan.tokens_per_step,
        interleave=cfg.parallel.collectives != "explicit",  # explicit runs gpipe and 1f1b only
    )
    base = _base(shape, n_params, cfg, model_cfg, plan)
    chosen = None
    if plan.recommend:
        chosen = _recommend(base, space, cluster, devices, cfg.parallel.mesh, given)
        setup = chosen.best.setup
    else:
        setup = _as_given(base, space, resolve_mesh(sizes, devices), cfg)
    out = summary.report(setup, cluster, name)
    optimizer, lr_args, lr_source = learning_rate(cfg, given, shape.embed_dim, setup.batch)
    out["lr"] = summary.lr_figures(optimizer, setup.batch) | {"source": lr_source}
    out["defaults"] = summary.defaults_used(
        setup, space, tuple(plan_flags.PLANNING_DEFAULTS), given
    )
    if chosen is not None:
        out["recommendation"] = chosen.as_dict([*model_args, *lr_args])
    if plan.measure:
        out["measured"] = _measure(setup, planned, cfg)
    if plan.plot:
        plot.draw(setup, cluster, chosen, plan.plot)
        out["plot"] = plan.plot
    print(json.dumps(out, indent=1) if plan.json else summary.format_report(out))
    return 0


def _base(shape: Any, n_params: float, cfg: Config, model_cfg: ModelConfig, plan: Any) -> Any:
    """The run on one device, before a mesh and batch are chosen for it."""
    return cost.Setup(
        shape=shape,
        n_params=n_params,
        mesh=dict.fromkeys(MESH_AXES, 1),
        zero=cfg.parallel.zero,
        precision=cfg.precision.precision,
        optimizer=cfg.optimizer.optimizer,
        batch=cfg.run.batch or 1,
        seq_len=cfg.run.seq_len,
        accum=cfg.run.accum,
        remat=model_cfg.remat,
        grad_reduce=cfg.precision.grad_reduce,
        schedule=cfg.parallel.pp_schedule,
        microbatches=1,
        virtual=cfg.parallel.pp_virtual,
        sync_every=cfg.parallel.sync_every if cfg.parallel.dcn_sync == "diloco" else 0,
        sequence_parallel=cfg.parallel.sequence_parallel,
        cp_mode="ulysses" if cfg.parallel.cp_mode == "ulysses" else "ring",  # auto: the ring
        offload=cfg.parallel.offload,
        **lora_base.planner_fields(model_cfg, cfg.lora),  # LoRA: a frozen base, adapters trained
        fp8_all_gather=cfg.precision.fp8_all_gather,
        adafactor_min_dim=cfg.optimizer.adafactor_min_dim,
        objective=cfg.run.objective,
        reference_precomputed=cfg.preference.dpo_precompute_reference,
    )


def _as_given(base: cost.Setup, space: search.Space, sizes: dict, cfg: Config) -> Any:
    """The layout the command line names, with its batch chosen when --batch is left out."""
    setup = dataclasses.replace(base, mesh=sizes)
    if setup.pipelined:
        setup = dataclasses.replace(
            setup, microbatches=cfg.parallel.microbatches or 2 * sizes["pipeline"]
        )
    ways = setup.data_parallel * setup.micro_steps
    setup = dataclasses.replace(setup, batch=search.batch_for(space, setup.seq_len, ways))
    cost.check_setup(setup)
    return setup


def _recommend(
    base: cost.Setup,
    space: search.Space,
    cluster: search.Cluster,
    devices: int,
    mesh: str,
    given: frozenset[str],
) -> recommend.Recommendation:
    """Search the layouts of `devices` devices, holding fixed what the command line fixes."""
    clash = [name for name in plan_flags.SEARCHED_ONLY if name in given]
    if clash:
        raise UsageError(
            f"{config.flag_name(clash[0])} is chosen by --recommend (it searches the micro-batch "
            f"and accumulation); drop it, or drop --recommend to plan it as given"
        )
    cost.check_setup(dataclasses.replace(base, batch=search.batch_for(space, base.seq_len, 1)))
    named = _named_axes(mesh, given) or {}
    if named.get("expert", 1) > 1 and not base.shape.n_experts:  # (else held fixed)
        raise UsageError(
            f"--mesh ep={named['expert']} splits experts, but the model has none; use ep=1 or "
            f"an MoE model (--n-experts, e.g. --model moe-small)"
        )
    if not base.shape.pipelines:  # e.g. an MoE's router losses (models.moe.check_layout)
        named = {"pipeline": 1, **named}
    space = dataclasses.replace(
        space,
        mesh=named or None,
        zero=base.zero if "zero" in given else None,
        remat=base.remat if "remat" in given else None,
        schedule=base.schedule if "pp_schedule" in given else None,
        virtual=base.virtual if "pp_virtual" in given else None,
        sequence_parallel=base.sequence_parallel if "sequence_parallel" in given else None,
        offload=base.offload if "offload" in given else None,
    )
    base = dataclasses.replace(base, mesh={**base.mesh, "data": devices})
    return recommend.recommend(base, space, cluster)


def _named_axes(mesh: str, given: frozenset[str]) -> dict[str, int] | None:
    """The axes a given --mesh (or --layout) names with a size, to hold fixed (-1 is free)."""
    if "mesh" not in given:
        return None
    parts = (part.partition("=") for part in mesh.split(",") if part.strip())
    named = {AXIS_ALIASES[name.strip().lower()]: int(size) for name, _, size in parts}
    return {axis: size for axis, size in named.items() if size != -1}


def engine_program(s: cost.Setup, model_cfg: ModelConfig, devices: list, cfg: Config | None = None):
    """(Program, Mesh) of layout `s` on `devices` as `python -m spmd.train` would build it
    (spmd.run.builder, the one builder), for the model `model_cfg` under run config `cfg` (default:
    the defaults). The engine has no stage 0: plain DDP is the fsdp devices folded into
    `data`."""

    measure.check_engine_can_build(s)
    cfg = cfg or Config(model=model_cfg)
    sizes = dict(s.sharding_mesh)
    parallel = dataclasses.replace(
        cfg.parallel,
        mesh=mesh_lib.format_mesh(sizes),
        zero=max(s.zero, 1),
        sequence_parallel=s.sequence_parallel,
        pp_schedule=s.schedule,
        microbatches=s.microbatches,
        pp_virtual=s.virtual,
        dcn_sync="every-step",
        offload=s.offload,
    )
    run_cfg = dataclasses.replace(cfg.run, batch=s.batch, seq_len=s.seq_len, accum=s.accum)
    precision = dataclasses.replace(cfg.precision, precision=s.precision)
    optimizer = dataclasses.replace(cfg.optimizer, optimizer=s.optimizer)
    engine_cfg = dataclasses.replace(
        cfg,
        model=model_cfg,
        run=run_cfg,
        parallel=parallel,
        precision=precision,
        optimizer=optimizer,
    )
    mesh = mesh_lib.build_mesh(sizes, devices)
    return builder.program(engine_cfg, mesh), mesh


def _measure(s: cost.Setup, model_cfg: ModelConfig, cfg: Config) -> dict:
    """Compile the layout's real train step on simulated CPU devices (spmd.estimate.measure)."""
    built = dataclasses.replace(model_cfg, remat=s.remat)
    s = dataclasses.replace(s, n_params=float(family.of(built).n_params(built)))
    measure.check_engine_can_build(s)
    devices = measure.simulated_devices(s.devices)
    program, mesh = engine_program(s, built, devices, cfg)
    return measure.measure(s, program, mesh, executor=cfg.parallel.collectives)


def lora_flags(lora: LoraConfig) -> list[str]:
    """The `spmd.train` flags of a [lora] section (none without LoRA; defaults left out)."""
    if not lora.lora_rank:
        return []
    flags = ["--lora-rank", str(lora.lora_rank)]
    for flag, value in (
        ("--lora-alpha", lora.lora_alpha),
        ("--lora-dropout", lora.lora_dropout),
        ("--lora-targets", lora.lora_targets),
        ("--lora-base-dtype", lora.lora_base_dtype),
    ):
        flags += [flag, f"{value:g}" if isinstance(value, float) else value] if value else []
    return flags


def learning_rate(
    cfg: Config, given: frozenset[str], embed_dim: int, batch: int
) -> tuple[Any, list[str], str]:
    """(the optimizer section the plan reports, the spmd.train flags that set its learning
    rate, where the rate came from). A --lr given is the run's, carried as given; otherwise
    the rule of spmd.estimate.lr_rule for the model's width and what the run trains (the --lr
    default is the small preset's, far too high for a large model)."""
    scaling = [
        arg
        for name in ("lr_scaling", "ref_batch")
        if name in given
        for arg in (config.flag_name(name), str(getattr(cfg.optimizer, name)))
    ]
    if "lr" in given:
        return cfg.optimizer, ["--lr", f"{cfg.optimizer.lr:g}", *scaling], "given"
    from_hf = bool(cfg.run.init_from_hf or cfg.run.init_from_peft)
    kind = lr_rule.regime(cfg.lora.lora_rank, from_hf)
    suggested = lr_rule.suggest(embed_dim, kind, cfg.optimizer.lr)
    lr = lr_rule.lr_for_peak(cfg.optimizer, suggested.peak_lr, batch)
    optimizer = dataclasses.replace(cfg.optimizer, lr=lr)
    flags = ["--lr", f"{lr:g}", *scaling] if lr != cfg.optimizer.lr else scaling
    return optimizer, flags, suggested.rule


def model_shape(given: frozenset[str], model_cfg: ModelConfig, cfg: Config, plan: Any) -> tuple:
    """(model config, parameter count, description, spmd.train model flags) of the preset, of
    --init-from-hf's config.json (--init-from-peft's base), or of the published shape that
    stands for --params; `given`: the fields the command line gave."""
    if cfg.run.init_from_hf:
        return _hf_model(given, model_cfg, cfg)
    if not plan.params:
        values = config.preset(cfg.run.model)
        preset = config.build(family.check_fields(values, "preset"), values, "preset")
        family.of(model_cfg).check(model_cfg)
        # every field the preset does not hold (the remat is the recommendation's own flag)
        fields = [f.name for f in dataclasses.fields(model_cfg) if f.name != "remat"]
        fields = ["family", *(f for f in fields if f != "family")]
        changed = [
            f for f in dict.fromkeys(fields) if getattr(model_cfg, f) != getattr(preset, f, None)
        ]
        args = ["--model", cfg.run.model, *_shape_flags(model_cfg, changed)]
        n_params = float(family.of(model_cfg).n_params(model_cfg))
        return model_cfg, n_params, f"{cfg.run.model} preset", args
    arch = {f.name for f in dataclasses.fields(model_section())} - {"remat"}
    clash = sorted(given & (arch | {"model"}))
    if clash:
        raise UsageError(
            f"--params {plan.params:g} chooses its own shape; drop {config.flag_name(clash[0])}"
            f" (or drop --params to plan the model as given)"
        )
    release = release_for(plan.params)
    shape = family.get("llama").config(**release.fields(), remat=model_cfg.remat)
    # the asked size is planned (the ZeRO paper's 7.5 B is 7.5 B), the release's shape scaled
    scaled = (
        f", scaled to the {plan.params / 1e9:.3g} B asked"
        if plan.params != release.n_params()
        else ""
    )
    described = (
        f"--params {plan.params:.3g} as {release.name}'s shape ({release.n_params() / 1e9:.2f} B "
        f"params: embed {shape.embed_dim}, {shape.n_layers} layers, {shape.n_heads} heads, "
        f"{shape.n_kv_heads} kv heads, mlp {shape.mlp_dim}, vocab {shape.vocab_size}){scaled}"
    )
    return shape, plan.params, described, _shape_flags(shape, list(release.fields()))


def _hf_model(given: frozenset[str], model_cfg: ModelConfig, cfg: Config) -> tuple:
    """model_shape's tuple for --init-from-hf (or --init-from-peft): the family config its
    config.json reads as, its real parameter count, and the flags that name it again."""
    fam = family.of(model_cfg)
    n_params = float(fam.n_params(model_cfg))
    shape = fam.shape(model_cfg)
    if cfg.run.init_from_peft:
        source = ["--init-from-peft", cfg.run.init_from_peft]
        if "init_from_hf" in given:
            source += ["--init-from-hf", cfg.run.init_from_hf]
    else:
        source = ["--init-from-hf", cfg.run.init_from_hf]
    knobs = [name for name in resolve.ROUTER_KNOBS if name in given]
    described = (
        f"{' '.join(source)} ({fam.name} family: embed {shape.embed_dim}, "
        f"{model_cfg.n_layers} layers, vocab {shape.vocab_size})"
    )
    return model_cfg, n_params, described, [*source, *_shape_flags(model_cfg, knobs)]


def _shape_flags(shape: Any, fields: Any) -> list[str]:
    """spmd.train flags that set these shape fields, e.g. ["--embed-dim", "4096"]."""
    out = []
    for field in fields:
        value = getattr(shape, field)
        out += [
            config.flag_name(field),
            str(value).lower() if isinstance(value, bool) else str(value),
        ]
    return out


if __name__ == "__main__":
    sys.exit(main())
