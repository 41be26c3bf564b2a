"""`python -m spmd.plan`: will a model fit, what will a step communicate, which layout to use.

    python -m spmd.plan --model 1b --devices 8 --zero 3 [--hbm 80] [--json]
    python -m spmd.plan --params 7e9 --devices 64 --recommend
    python -m spmd.plan --model tiny --mesh dp=2,fsdp=2,tp=2 --measure

Prints the analytic model of spmd.estimate.cost for one layout (or, with --recommend, for the layout
spmd.estimate.recommend proposes): memory per device against the HBM, the collectives of one
optimizer
step with their ring times, compute time and the batch arithmetic. --measure compiles the real
train step on simulated CPU devices and puts its figures beside the analytic ones. Every flag of
`python -m spmd.train` is accepted, so a training command line can be planned as it is. Units:
bytes, seconds; GB = 1e9 bytes, GB/s = 1e9 bytes/s, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import typing
from typing import Any

from models import llama
from spmd import config
from spmd.config import TrainConfig
from spmd.engine.optim import peak_lr
from spmd.errors import UsageError
from spmd.estimate import cost, measure, recommend
from spmd.parallel.mesh import MESH_AXES, format_mesh, parse_mesh, resolve_mesh


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The planner's own settings. Units in comments (GB = 1e9 bytes)."""

    params: float = 0.0  # plan for this many parameters, e.g. 7e9 (0: the --model preset)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (the engine's) | mixed (bf16 + fp32 master)
    optimizer: str = "adamw"  # adamw | momentum | sgd
    hbm: float = 80.0  # GB of memory per device
    overhead: float = 3.0  # GB per device for the runtime, communication buffers, fragmentation
    bandwidth: float = 400.0  # GB/s per device between devices of one node
    inter_bandwidth: float = 50.0  # GB/s per device between nodes
    latency: float = 5e-6  # seconds per ring step
    devices_per_node: int = 8
    tflops: float = 400.0  # sustained TFLOP/s per device
    recommend: bool = False  # choose the mesh and ZeRO stage (--mesh and --zero are ignored)
    measure: bool = False  # compile the real step on simulated CPU devices and compare
    json: bool = False  # print one JSON object instead of the table


def _own_fields(cls: type, taken: type) -> type:
    """`cls` without the fields `taken` already defines: a flag has one owner (e.g. once
    TrainConfig has `precision`, the train section's default is the one that counts)."""
    names = {f.name for f in dataclasses.fields(taken)}
    hints = typing.get_type_hints(cls)
    kept = [f for f in dataclasses.fields(cls) if f.name not in names]
    if len(kept) == len(dataclasses.fields(cls)):
        return cls
    fields = [(f.name, hints[f.name], dataclasses.field(default=f.default)) for f in kept]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True)


PLAN_SECTION = _own_fields(PlanConfig, TrainConfig)
SECTIONS = {"model": llama.LlamaConfig, "train": TrainConfig, "plan": PLAN_SECTION}
# The training flags that change the plan; the rest of spmd.train's are accepted and ignored.
TRAIN_FLAGS = ("model", "layout", "mesh", "devices", "zero", "batch", "accum", "seq_len")
TRAIN_FLAGS += ("lr", "lr_scaling", "ref_batch", "precision", "collectives")
HELP = {
    "params": "parameters to plan for, e.g. 7e9: a Llama-like shape of that size is used "
    "for activations (0: the --model preset)",
    "precision": "fp32, bf16, fp16 (the engine's: fp32 params and Adam state, compute in "
    "the dtype) or mixed (bf16 params and grads + fp32 master copy, the ZeRO paper's 16 B/param)",
    "optimizer": "adamw (8 B/param of state), momentum (4) or sgd (0)",
    "hbm": "memory per device, GB (1e9 bytes)",
    "overhead": "GB per device reserved for the runtime, communication buffers, fragmentation",
    "bandwidth": "GB/s per device between devices of one node",
    "inter_bandwidth": "GB/s per device between nodes",
    "latency": "seconds per ring step (5e-6 = 5 microseconds)",
    "devices_per_node": "devices per node: tp stays within one; wider groups use --inter-bandwidth",
    "tflops": "sustained TFLOP/s per device, for the compute time",
    "recommend": "propose the mesh (dp, fsdp, tp, pp) and ZeRO stage, with reasons",
    "measure": "compile the real train step on simulated CPU devices; show analytic vs compiled",
    "json": "print one JSON object (bytes, seconds) instead of the table",
    "model": "model preset: configs/NAME.toml",
    "layout": "named layout from meshes/ (ddp, zero3, megatron, ...): sets --mesh and --zero",
    "mesh": "e.g. dp=2,fsdp=2,tp=2,pp=1 (one axis may be -1); default: every device "
    "data-parallel, on fsdp for --zero 1-3, on dp for --zero 0",
    "devices": "device count (default: what the mesh needs, else --devices-per-node)",
    "zero": "0 = plain DDP; 1, 2, 3 = ZeRO stage of the fsdp axis",
    "batch": "global batch, sequences per optimizer step",
    "accum": "micro-batches per optimizer step (pipeline micro-batches when pp > 1)",
    "seq_len": "tokens per sequence",
    "lr": "peak learning rate before the scaling rule",
    "lr_scaling": "none, or linear: lr x batch / ref-batch",
    "ref_batch": "the global batch at which --lr was tuned",
    "remat": "none, full or dots_saveable: what the backward pass keeps",
}


def _help_parser() -> argparse.ArgumentParser:
    """The --help text: the planner's flags, the training flags that matter, the model's."""
    hints = typing.get_type_hints(TrainConfig)
    view = dataclasses.make_dataclass(
        "TrainFlags",
        [
            (f.name, hints[f.name], dataclasses.field(default=f.default))
            for f in dataclasses.fields(TrainConfig)
            if f.name in TRAIN_FLAGS
        ],
    )
    sections = {"plan": PLAN_SECTION, "training run (every spmd.train flag is accepted)": view}
    sections["model (with --params only --remat applies)"] = llama.LlamaConfig
    parser = config.build_parser("python -m spmd.plan", sections, __doc__.split("\n\n")[1])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = {
        f.name: f.default
        for cls in sections.values()
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING
    }
    for action in parser._actions:
        action.help = HELP.get(action.dest, action.help)
        if action.dest in defaults and action.dest not in ("mesh", "devices"):  # see HELP
            action.help = f"{action.help or ''} (default {defaults[action.dest]!r})".lstrip()
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _expand(values: dict[str, Any]) -> dict[str, Any]:
    """--layout fills --mesh and --zero; without a mesh every device is data-parallel, on
    the fsdp axis that the ZeRO stage shards (or on dp for --zero 0)."""
    from spmd.train import expand_layout

    values = expand_layout(values)
    if "mesh" not in values:
        values["mesh"] = "dp=-1" if values.get("zero", TrainConfig.zero) == 0 else "fsdp=-1"
    return values


def _value(sections: dict[str, Any], name: str) -> Any:
    """A field of whichever section defines it."""
    return next(getattr(v, name) for v in sections.values() if hasattr(v, name))


def check_values(train: TrainConfig, plan: Any) -> None:
    """UsageError for a planner or batch value outside its range."""
    for name in ("hbm", "bandwidth", "inter_bandwidth", "tflops", "devices_per_node"):
        if getattr(plan, name) <= 0:
            raise UsageError(f"{config.flag_name(name)} {getattr(plan, name)} must be positive")
    for name in ("overhead", "latency", "params"):
        if getattr(plan, name) < 0:
            raise UsageError(f"{config.flag_name(name)} {getattr(plan, name)} must be >= 0")
    for name in ("accum", "batch", "seq_len", "devices"):
        if getattr(train, name) < (0 if name == "devices" else 1):
            raise UsageError(f"{config.flag_name(name)} {getattr(train, name)} is out of range")


def run(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        _help_parser().print_help()
        return 0
    sections = config.resolve(argv, SECTIONS, "python -m spmd.plan", expand_train=_expand)
    train, model_cfg, plan = sections["train"], sections["model"], sections["plan"]
    check_values(train, plan)
    shape, n_params, name = model_shape(argv, model_cfg, train, plan)
    sizes = parse_mesh(train.mesh)
    devices = train.devices or (
        plan.devices_per_node if -1 in sizes.values() else math.prod(sizes.values())
    )
    if plan.recommend:  # validated on one device first; the search picks mesh and stage
        sizes, zero = dict.fromkeys(MESH_AXES, 1), 0
    else:
        sizes, zero = resolve_mesh(sizes, devices), train.zero
    setup = cost.Setup(
        shape=shape,
        n_params=n_params,
        mesh=sizes,
        zero=zero,
        precision=_value(sections, "precision"),
        optimizer=plan.optimizer,
        batch=train.batch,
        seq_len=train.seq_len,
        accum=train.accum,
    )
    cost.check_setup(setup)
    network = cost.Network(
        plan.bandwidth * 1e9, plan.inter_bandwidth * 1e9, plan.latency, plan.devices_per_node
    )
    chosen = None
    if plan.recommend:
        setup = dataclasses.replace(setup, mesh={**sizes, "data": devices})
        chosen = recommend.recommend(
            setup, network, plan.tflops * 1e12, plan.overhead * 1e9, plan.hbm * 1e9
        )
        setup = chosen.best.setup
    out = report(setup, network, plan, train, name)
    if chosen is not None:
        out["recommendation"] = {
            "mesh_text": format_mesh(setup.mesh),
            "zero": setup.zero,
            "reasons": chosen.reasons,
            "layouts_considered": chosen.considered,
            "layouts_fitting": chosen.fitting,
            "runner_up": chosen.runner_up.label() if chosen.runner_up else None,
        }
    if plan.measure:
        out["measured"] = measure.measure(
            dataclasses.replace(setup, n_params=float(shape.n_params())),
            lambda seed, dtype: llama.create(shape, seed, dtype),
            llama.lm_loss,
            train,
        )
    print(json.dumps(out, indent=1) if plan.json else format_report(out))
    return 0


def model_shape(argv: list[str], model_cfg: Any, train: TrainConfig, plan: Any) -> tuple:
    """(shape, parameter count, description) of the preset, or of --params' Llama shape."""
    if not plan.params:
        return model_cfg, float(model_cfg.n_params()), f"{train.model} preset"
    arch = {f.name for f in dataclasses.fields(llama.LlamaConfig)} - {"remat"}
    given = {a.split("=")[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
    clash = sorted(given & (arch | {"model"}))
    if clash:
        raise UsageError(
            f"--params {plan.params:g} chooses its own shape; drop {config.flag_name(clash[0])}"
            f" (or drop --params to plan the model as given)"
        )
    shape = llama.LlamaConfig(**cost.llama_shape(plan.params), remat=model_cfg.remat)
    described = (
        f"--params {plan.params:.3g} as a Llama shape (embed {shape.embed_dim}, "
        f"{shape.n_layers} layers, {shape.n_heads} heads, mlp {shape.mlp_dim})"
    )
    return shape, plan.params, described


def report(s: cost.Setup, net: cost.Network, plan: Any, train: TrainConfig, name: str) -> dict:
    """The plan as plain JSON values: bytes per device, bytes and seconds per step."""
    mem = cost.memory(s, plan.overhead * 1e9, plan.hbm * 1e9)
    comms = cost.collectives(s)
    rows = [
        {
            "kind": c.kind,
            "axes": "+".join(c.axes),
            "purpose": c.purpose,
            "group": c.group,
            "count": c.count,
            "bytes": round(c.bytes * c.count),
            "wire_bytes": round(cost.wire_bytes(c) * c.count),
            "link_gb_s": cost.link_bandwidth(s, c.axes, net) / 1e9,
            "time_s": cost.comm_time(s, c, net),
        }
        for c in comms
    ]

    def per_kind(key: str) -> dict:
        return {
            k: sum(r[key] for r in rows if r["kind"] == k)
            for k in dict.fromkeys(r["kind"] for r in rows)
        }

    compute = cost.compute_time(s, plan.tflops * 1e12)
    comm = sum(r["time_s"] for r in rows)
    shape_fields = ("vocab_size", "embed_dim", "mlp_dim", "n_layers", "n_heads", "n_kv_heads")
    return {
        "units": "bytes per device, seconds per optimizer step; GB = 1e9 bytes",
        "model": name,
        "n_params": s.n_params,
        "shape": {k: getattr(s.shape, k) for k in (*shape_fields, "head_dim", "remat")},
        "devices": s.devices,
        "mesh": s.mesh,
        "mesh_text": format_mesh(s.mesh),
        "zero": s.zero,
        "precision": s.precision,
        "optimizer": s.optimizer,
        "bytes_per_param": cost.bytes_per_param(s),
        "params_bytes_per_device": round(mem["params"]),
        "grads_bytes_per_device": round(mem["grads"]),
        "optimizer_bytes_per_device": round(mem["optimizer"]),
        "model_state_bytes_per_device": round(mem["model_state"]),
        "activation_bytes_per_device": round(mem["activations"]),
        "overhead_bytes_per_device": round(mem["overhead"]),
        "total_bytes_per_device": round(mem["total"]),
        "hbm_bytes_per_device": round(mem["hbm"]),
        "headroom_bytes": round(mem["headroom"]),
        "fits": mem["fits"],
        "comm_bytes_per_step": per_kind("bytes"),
        "comm_wire_bytes_per_step": per_kind("wire_bytes"),
        "comm_time_s_per_step": per_kind("time_s"),
        "collectives": rows,
        "flops_per_step": cost.flops_per_step(s),
        "tflops": plan.tflops,
        "compute_time_s": compute,
        "comm_time_s": comm,
        "comm_compute_ratio": comm / compute,
        "batch": {
            "micro_batch_per_device": s.micro_batch,
            "data_parallel": s.data_parallel,
            "accum": s.accum,
            "global": cost.global_batch(s.micro_batch, s.data_parallel, s.accum),
            "seq_len": s.seq_len,
            "lr": train.lr,
            "lr_scaling": train.lr_scaling,
            "ref_batch": train.ref_batch,
            "peak_lr": peak_lr(train),
        },
    }


def _si(n: float, unit: str = "B") -> str:
    """A decimal-prefixed quantity: 1 kB = 1e3 B, 1 GB = 1e9 B."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def format_report(r: dict) -> str:
    """The plan as a table (decimal units: 1 GB = 1e9 bytes, not GiB)."""
    batch, per_param, mesh = r["batch"], r["bytes_per_param"], r["mesh_text"]
    fsdp = r["mesh"]["fsdp"]
    zero = f"ZeRO-{r['zero']} over fsdp={fsdp}" if r["zero"] and fsdp > 1 else "no ZeRO sharding"
    lines = [
        f"plan: {r['model']}, {r['n_params'] / 1e6:,.2f} M params | {r['devices']} devices, "
        f"mesh {mesh}, {zero} | {r['precision']}, {r['optimizer']}",
        f"batch: micro-batch {batch['micro_batch_per_device']} per device x data-parallel "
        f"{batch['data_parallel']} x accum {batch['accum']} = global batch {batch['global']} "
        f"of {batch['seq_len']} tokens | lr {batch['lr']:g} -> {batch['peak_lr']:g} "
        f"({batch['lr_scaling']} scaling, reference batch {batch['ref_batch']})",
    ]
    if "recommendation" in r:
        rec = r["recommendation"]
        lines.append(f"recommended: --mesh {rec['mesh_text']} --zero {rec['zero']}")
        lines += [f"  - {line}" for line in rec["reasons"]]
    total_pp = sum(per_param.values())
    lines += [
        "",
        f"memory per device (1 GB = 1e9 bytes)       {per_param['params']} + "
        f"{per_param['grads']} + {per_param['optimizer']} = {total_pp} B/param unsharded",
    ]
    labels = {"params": "params", "grads": "gradients", "optimizer": "optimizer state"}
    labels |= {"model_state": "model state (sum)"}
    labels |= {"activation": f"activations (remat {r['shape']['remat']})"}
    labels |= {"overhead": "overhead (runtime, buffers)", "total": "total"}
    for key, label in labels.items():
        lines.append(f"  {label:<32}{_si(r[f'{key}_bytes_per_device']):>12}")
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines.append(
        f"  of {_si(r['hbm_bytes_per_device'])} HBM: {verdict}, headroom {_si(r['headroom_bytes'])}"
    )
    lines += [
        "",
        f"collectives per step     {'axes':<11}{'N':>4}{'count':>7}"
        f"{'bytes/step':>13}{'wire/step':>13}{'link':>11}{'time':>11}",
    ]
    for c in r["collectives"]:
        lines.append(
            f"  {c['kind']:<22} {c['axes']:<11}{c['group']:>4}{c['count']:>7}"
            f"{_si(c['bytes']):>13}{_si(c['wire_bytes']):>13}{c['link_gb_s']:>7g} GB/s"
            f"{recommend.ms(c['time_s']):>11}  ({c['purpose']})"
        )
    if not r["collectives"]:
        lines.append("  none (one device)")
    lines.append(
        f"time per step: compute {recommend.ms(r['compute_time_s'])} at {r['tflops']:g} "
        f"TFLOP/s per device, communication {recommend.ms(r['comm_time_s'])} if not "
        f"overlapped: comm/compute {r['comm_compute_ratio']:.3g}"
    )
    if "measured" in r:
        m = r["measured"]
        lines += [
            "",
            f"analytic vs compiled ({m['device']}, {m['executor']} executor, "
            f"{m['n_params']:,} params, compiled in {m['compile_s']:.1f} s)",
            f"  {'bytes per device':<34}{'analytic':>12}{'compiled':>12}",
        ]
        for label, row in m["rows"].items():
            ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
            lines.append(
                f"  {label:<34}{_si(row['analytic']):>12}{_si(row['compiled']):>12}  ratio {ratio}"
            )
        lines += [f"  note: {note}" for note in m["notes"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
