"""The plan of one layout as plain JSON values, and as the table `python -m spmd.plan` prints.

Units: bytes per device, bytes and seconds per optimizer step; GB = 1e9 bytes (decimal, not
GiB), GB/s = 1e9 bytes/s, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spmd.engine.optim import peak_lr
from spmd.estimate import comms, cost, experts, memory, offload, pipeline_figures, search, timing
from spmd.estimate.lora import adapter_params, state_words
from spmd.estimate.shape import shape_params
from spmd.estimate.units import ms, si
from spmd.estimate.volumes import all_to_all
from spmd.parallel.mesh import format_mesh
from spmd.sections import OptimizerConfig

MEMORY_ROLES = {
    "params": "params",
    "grads": "gradients",
    "optimizer": "master + optimizer state",
    "activations": "activations",
    "overhead": "overhead (runtime, buffers)",
}


def collective_rows(s: cost.Setup, net: cost.Network) -> list[dict]:
    """One row per collective of a step: kind, axes, group, count, bytes, wire bytes (what
    one device sends on a ring), link GB/s, seconds and whether compute can hide it."""
    return [
        {
            "kind": c.kind,
            "axes": "+".join(c.axes),
            "purpose": c.purpose,
            "group": c.group,
            "count": c.count,
            "bytes": round(c.bytes * c.count),
            "wire_bytes": round(comms.wire_bytes(c) * c.count),
            "link_gb_s": comms.link_bandwidth(s, c.axes, net) / 1e9,
            "time_s": comms.comm_time(s, c, net),
            "hideable": c.hideable,
        }
        for c in comms.collectives(s)
    ]


def expert_figures(s: cost.Setup, mem: dict) -> dict[str, Any]:
    """An MoE's figures: experts, top-k, capacity per sequence, active params per token, the
    routed experts' params and model-state bytes per device, and the token all-to-all bytes
    per MoE layer per step on one device (spmd.estimate.volumes.all_to_all)."""
    shape = s.shape
    moved = all_to_all(
        shape,
        s.sharding_mesh,
        s.batch,
        s.seq_len,
        s.micro_steps,
        s.remat != "none",
        s.bytes_of("compute"),
        experts.exchange_dispatch(s.sharding_mesh, s.sequence_parallel, s.precision),
    )
    return {
        "n_experts": shape.n_experts,
        "experts_per_token": shape.experts_per_token,
        "capacity": experts.capacity(shape, s.seq_len),
        "active_params": experts.active_params(shape, shape_params(shape)),
        "expert_params": experts.expert_params(shape),
        "expert_params_per_device": cost.params_per_device(s, True, experts=True),
        "expert_bytes_per_device": round(mem["experts"]),
        "all_to_all_bytes_per_layer": moved.get("bytes_per_layer", 0),
        "all_to_all_count_per_layer": moved.get("count", 0) // shape.sparse_layers,
    }


def sequence_figures(s: cost.Setup) -> dict[str, Any]:
    """Context and sequence parallelism's figures: tokens of a sequence per device, the ring's
    sends or Ulysses' all-to-alls (--cp-mode) and their bytes per layer per step
    (spmd.estimate.volumes, the formulas theory checks against compiled HLO), and the
    activations per device without either split."""
    layers = s.shape.n_layers // s.mesh["pipeline"]
    whole = dataclasses.replace(s, mesh={**s.mesh, "context": 1}, sequence_parallel=False)
    traffic = {"collective-permute": (0.0, 0.0), "all-to-all": (0.0, 0.0)}
    for c in comms.context_collectives(s):
        traffic[c.kind] = (c.count, c.count * c.bytes)
    (sends, ring), (calls, moved) = traffic["collective-permute"], traffic["all-to-all"]
    return {
        "context": s.context,
        "sequence_parallel": s.sequence_parallel,
        "cp_mode": s.cp_mode,
        "tokens_per_device": s.seq_len // s.context,
        "ring_count_per_layer": int(sends) // layers,
        "ring_bytes_per_layer": round(ring / layers),
        "ulysses_count_per_layer": int(calls) // layers,
        "ulysses_bytes_per_layer": round(moved / layers),
        "activation_bytes_unsplit": round(memory.activation_bytes(whole)),
    }


def _sequence_lines(r: dict) -> list[str]:
    if "long_sequence" not in r:
        return []
    x, split = r["long_sequence"], []
    if x["context"] > 1:
        how = " (ulysses)" if x.get("cp_mode") == "ulysses" else ""
        split.append(
            f"cp={x['context']}{how}: every activation holds {x['tokens_per_device']} tokens"
        )
    if x["sequence_parallel"]:
        split.append("SP: the residual stream split over tp too")
    lines = ["", f"long sequences: {'; '.join(split)}"]
    lines.append(
        f"  activations per device {si(r['activation_bytes_per_device']):>12} (without the "
        f"split {si(x['activation_bytes_unsplit'])})"
    )
    if x["ring_count_per_layer"]:
        lines.append(
            f"  ring per layer           {si(x['ring_bytes_per_layer']):>12} per step "
            f"({x['ring_count_per_layer']} collective-permutes of a key or value block)"
        )
    if x.get("ulysses_count_per_layer"):
        lines.append(
            f"  ulysses per layer        {si(x['ulysses_bytes_per_layer']):>12} per step "
            f"({x['ulysses_count_per_layer']} all-to-alls of q, k, v or the output)"
        )
    return lines


def _expert_lines(r: dict) -> list[str]:
    if "experts" not in r:
        return []
    x = r["experts"]
    ways = x["expert_params"] / x["expert_params_per_device"]
    return [
        "",
        f"experts: {x['n_experts']} per layer, top-{x['experts_per_token']}, capacity "
        f"{x['capacity']} per sequence, {x['active_params'] / 1e6:,.2f} M active params per token",
        f"  experts' params per device{si(x['expert_params_per_device'], ''):>14} "
        f"(1/{ways:g} of {si(x['expert_params'], '')}), their model state "
        f"{si(x['expert_bytes_per_device'])} of the {si(r['model_state_bytes_per_device'])} above",
        f"  all-to-all per MoE layer  {si(x['all_to_all_bytes_per_layer']):>14} per step "
        f"({x['all_to_all_count_per_layer']} calls: dispatch and combine, forward and backward)"
        if x["all_to_all_count_per_layer"]
        else "  no all-to-all: no mesh axis splits the experts (ep = fsdp = 1)",
    ]


def report(s: cost.Setup, cluster: search.Cluster, name: str) -> dict[str, Any]:
    """The plan of layout `s` on `cluster` as plain JSON values (bytes, seconds)."""
    mem = cluster.memory(s)
    rows = collective_rows(s, cluster.net)
    t = timing.step_time(s, cluster.net, cluster.flops, cluster.overlap)

    def per_kind(key: str) -> dict:
        kinds = dict.fromkeys(r["kind"] for r in rows)
        return {k: sum(r[key] for r in rows if r["kind"] == k) for k in kinds}

    shape_fields = ("vocab_size", "embed_dim", "mlp_dim", "n_layers", "n_heads", "n_kv_heads")
    out = {
        "units": "bytes per device, seconds per optimizer step; GB = 1e9 bytes",
        "model": name,
        "n_params": s.n_params,
        "shape": {k: getattr(s.shape, k) for k in (*shape_fields, "head_dim")},
        "devices": s.devices,
        "mesh": s.mesh,
        "mesh_text": format_mesh(s.mesh),
        "zero": s.zero,
        "precision": s.precision,
        "grad_dtype": s.grad_dtype,
        "optimizer": s.optimizer,
        "remat": s.remat,
        "sequence_parallel": s.sequence_parallel,
        "bytes_per_param": memory.bytes_per_param(s),
    }
    if s.reference_forward:  # DPO: its reference's forward, and a full fine-tune's copy
        out["reference"] = timing.reference_words(s, mem)
    if s.lora_rank:
        out["lora"] = {
            "rank": s.lora_rank,
            "adapter_params": adapter_params(s),
            "base_dtype": s.lora_base_dtype,
        }
    for role in (*MEMORY_ROLES, "model_state", "total", "hbm"):
        key = "activation" if role == "activations" else role
        out[f"{key}_bytes_per_device"] = round(mem[role])
    out.update(headroom_bytes=round(mem["headroom"]), fits=mem["fits"], offload=s.offload)
    out["host"] = offload.figures(s, mem, t, cluster.net)
    out.update(
        comm_bytes_per_step=per_kind("bytes"),
        comm_wire_bytes_per_step=per_kind("wire_bytes"),
        comm_time_s_per_step=per_kind("time_s"),
        collectives=rows,
        flops_per_step=timing.model_flops(s),
        executed_flops_per_step=timing.executed_flops(s),
        tflops=cluster.flops / 1e12,
        overlap=cluster.overlap,
        compute_time_s=t["compute"],
        bubble_time_s=t["bubble"],
        comm_time_s=t["comm"],
        exposed_comm_time_s=t["exposed"],
        step_time_s=t["step"],
        comm_compute_ratio=t["comm"] / t["compute"],
        host_time_s=t["host"],
        overhead_ratio=(t["exposed"] + t["bubble"] + t["host"]) / t["compute"],
        tokens_per_s=s.batch * s.seq_len / t["step"],
        batch=batch_figures(s),
    )
    out["zero_stages"] = [
        {"zero": v.zero, "mesh_text": format_mesh(v.mesh)}
        | {
            role: round(value)
            for role, value in memory.memory(v, cluster.overhead, 0).items()
            if role in (*MEMORY_ROLES, "total")
        }
        for v in memory.zero_stages(s)
    ]
    if s.shape.n_experts:
        out["experts"] = expert_figures(s, mem)
    if s.context > 1 or s.sequence_parallel:
        out["long_sequence"] = sequence_figures(s)
    if s.pipelined:
        out["pipeline"] = {
            "schedule": s.schedule,
            "stages": s.mesh["pipeline"],
            "virtual": s.virtual,
            "microbatches": s.micro_steps,
            "ticks": pipeline_figures.pipeline_ticks(s),
            "stashed_per_stage": pipeline_figures.stashed_inputs(s),
            "bubble_share": pipeline_figures.bubble_share(s),
        }
    return out


def lr_figures(optimizer: OptimizerConfig, global_batch: int) -> dict[str, Any]:
    """The learning rate before and after --lr-scaling at the planned global batch."""
    return {
        "lr": optimizer.lr,
        "lr_scaling": optimizer.lr_scaling,
        "ref_batch": optimizer.ref_batch,
        "peak_lr": peak_lr(optimizer, global_batch),
    }


def defaults_used(
    s: cost.Setup, space: search.Space, planning_defaults: tuple[str, ...], given: set[str]
) -> list[str]:
    """One line naming the planning defaults that stood in for flags not `given` (the
    `planning_defaults` fields of `s`, and the batch chosen from --tokens-per-step)."""
    notes = [
        f"--{name.replace('_', '-')} {getattr(s, name)} (the planning default)"
        for name in planning_defaults
        if name not in given
    ]
    if not space.batch:
        notes.append(
            f"--batch {s.batch}: about --tokens-per-step {space.tokens} tokens, a multiple of "
            f"the data-parallel size {s.data_parallel} x {s.micro_steps} micro-batches"
        )
    return [f"not given, so planned with {'; '.join(notes)}"] if notes else []


def batch_figures(s: cost.Setup) -> dict[str, Any]:
    """Micro-batch x data-parallel x micro-batches per step = global batch, and tokens."""
    return {
        "micro_batch_per_device": s.micro_batch,
        "data_parallel": s.data_parallel,
        "accum": s.accum,
        "pipeline_microbatches": s.microbatches if s.pipelined else 0,
        "global": cost.global_batch(s.micro_batch, s.data_parallel, s.micro_steps),
        "seq_len": s.seq_len,
        "tokens": s.batch * s.seq_len,
    }


def _header(r: dict) -> list[str]:
    batch, mesh, fsdp = r["batch"], r["mesh_text"], r["mesh"]["fsdp"]
    zero = f"ZeRO-{r['zero']} over fsdp={fsdp}" if r["zero"] and fsdp > 1 else "no ZeRO sharding"
    steps = f"accum {batch['accum']}"
    if batch["pipeline_microbatches"]:
        steps += f" x {batch['pipeline_microbatches']} pipeline micro-batches"
    lines = [
        f"plan: {r['model']}, {r['n_params'] / 1e6:,.2f} M params | {r['devices']} devices, "
        f"mesh {mesh}, {zero} | {r['precision']} (gradients {r['grad_dtype']}), "
        f"{r['optimizer']}, remat {r['remat']}"
        + (", sequence parallel" if r["sequence_parallel"] else ""),
        f"batch: micro-batch {batch['micro_batch_per_device']} per device x data-parallel "
        f"{batch['data_parallel']} x {steps} = global batch {batch['global']} of "
        f"{batch['seq_len']} tokens ({si(batch['tokens'], '')} tokens per step)",
    ]
    if "lr" in r:
        lr = r["lr"]
        source = lr.get("source", "given")
        source = "given" if source == "given" else f"the planner's rule {source}"
        lines[-1] += (
            f" | lr {lr['lr']:g} -> {lr['peak_lr']:g} ({lr['lr_scaling']} scaling, "
            f"reference batch {lr['ref_batch']}; --lr {source})"
        )
    lines += [f"  {note}" for note in r.get("defaults", [])]
    return lines


def _memory_lines(r: dict) -> list[str]:
    per_param = r["bytes_per_param"]
    kept = (
        f"{per_param['params']} + {per_param['grads']} + {per_param['optimizer']:g} = "
        f"{sum(per_param.values()):g} B/param"
    )
    if "lora" in r:
        kept = state_words(per_param, r["lora"]["adapter_params"], r["lora"]["base_dtype"])
    lines = [
        "",
        f"memory per device (1 GB = 1e9 bytes)       {kept} unsharded (params + gradients + "
        f"master and optimizer)",
    ]
    labels = {k: v for k, v in MEMORY_ROLES.items() if k != "activations"}
    labels |= {"activation": f"activations (remat {r['remat']})", "total": "total"}
    labels = dict(sorted(labels.items(), key=lambda kv: kv[0] in ("overhead", "total")))
    on_host = memory.HOST_ROLES[r["offload"]]
    for key, label in labels.items():
        where = "  in host memory (--offload)" if key in on_host else ""
        if key in on_host and key not in memory.OFF_DEVICE_IN_STEP:
            where = "  in host memory between steps, on the device in the step"
        lines.append(f"  {label:<32}{si(r[f'{key}_bytes_per_device']):>12}{where}")
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines.append(
        f"  of {si(r['hbm_bytes_per_device'])} HBM: {verdict}, headroom {si(r['headroom_bytes'])}"
        + (" (the total is device memory's)" if on_host else "")
    )
    lines += offload.lines(r["host"])
    if not r["fits"] and "recommendation" not in r:
        lines.append(
            f"  --recommend --mesh {r['mesh_text']} --zero {r['zero']} searches the micro-batch, "
            f"accum and remat that fit this mesh"
        )
    lines += ["", f"by ZeRO stage over all {r['devices']} devices (the same micro-batch and remat)"]
    lines.append(
        f"  {'stage':<16}{'params':>11}{'gradients':>11}{'master+opt':>11}{'activations':>12}"
        f"{'total':>11}"
    )
    for z in r["zero_stages"]:
        roles = ("params", "grads", "optimizer", "activations", "total")
        lines.append(
            f"  {z['zero']} {z['mesh_text']:<14}"
            + "".join(f"{si(z[k]):>11}" for k in roles[:3])
            + f"{si(z['activations']):>12}{si(z['total']):>11}"
        )
    return lines


def _time_lines(r: dict) -> list[str]:
    lines = [
        "",
        f"collectives per step     {'axes':<11}{'N':>4}{'count':>7}"
        f"{'bytes/step':>13}{'wire/step':>13}{'link':>11}{'time':>11}",
    ]
    for c in r["collectives"]:
        lines.append(
            f"  {c['kind']:<22} {c['axes']:<11}{c['group']:>4}{c['count']:>7}"
            f"{si(c['bytes']):>13}{si(c['wire_bytes']):>13}{c['link_gb_s']:>7g} GB/s"
            f"{ms(c['time_s']):>11}  ({c['purpose']})"
        )
    if not r["collectives"]:
        lines.append("  none (one device)")
    if "pipeline" in r:
        p = r["pipeline"]
        chunks = f" x {p['virtual']} chunks" if p["virtual"] > 1 else ""
        lines.append(
            f"pipeline: {p['schedule']} over {p['stages']} stages{chunks}, {p['microbatches']} "
            f"micro-batches, {p['ticks']} ticks, {p['stashed_per_stage']} stashed per stage, "
            f"bubble {p['bubble_share']:.1%} of the step"
        )
    hidden = f", {r['overlap']:.0%} of data-parallel traffic hidden" if r["overlap"] else ""
    host = f" + host transfers {ms(r['host_time_s'])}" if r["host_time_s"] else ""
    lines.append(
        f"time per step: {ms(r['step_time_s'])} = compute {ms(r['compute_time_s'])} at "
        f"{r['tflops']:g} TFLOP/s per device + exposed communication "
        f"{ms(r['exposed_comm_time_s'])}{hidden} + bubble {ms(r['bubble_time_s'])}{host}: "
        f"(comm + bubble{' + host' if host else ''}) / compute {r['overhead_ratio']:.3g}, "
        f"{si(r['tokens_per_s'], '')} tokens/s"
    )
    return lines


def _recommendation_lines(rec: dict) -> list[str]:
    lines = [
        "",
        f"recommended: --mesh {rec['mesh_text']} --zero {rec['zero']} ({rec['fitting']} of "
        f"{rec['considered']} candidates fit)",
    ]
    lines += [f"  - {line}" for line in rec["reasons"]]
    if rec["runner_ups"]:
        lines.append("  runner-ups (the best of each other tp, pp and ZeRO stage):")
        for c in rec["runner_ups"]:
            slower = "tie" if abs(c["slower"]) < 5e-4 else f"{c['slower']:+.1%}"
            lines.append(
                f"    {ms(c['step_time_s']):>9}  ({slower})  {c['label']}, "
                f"{si(c['total_bytes_per_device'])} per device"
            )
    return lines + ["", "run it:", "  " + rec["train_command"]]


def _measured_lines(m: dict) -> list[str]:
    lines = [
        "",
        f"analytic vs compiled ({m['device']}, {m['executor']} executor, "
        f"{m['n_params']:,} params, mesh {m['mesh_text']}, compiled in {m['compile_s']:.1f} s)",
        f"  {'bytes per device':<34}{'analytic':>12}{'compiled':>12}",
    ]
    for label, row in m["rows"].items():
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        lines.append(
            f"  {label:<34}{si(row['analytic']):>12}{si(row['compiled']):>12}  ratio {ratio}"
        )
    return lines + [f"  note: {note}" for note in m["notes"]]


def format_report(r: dict) -> str:
    """The plan as a table (decimal units: 1 GB = 1e9 bytes, not GiB)."""
    lines = _header(r) + _memory_lines(r) + _expert_lines(r) + _sequence_lines(r)
    lines += [f"  {r['reference']}"] if "reference" in r else []
    lines += _time_lines(r)
    if "measured" in r:
        lines += _measured_lines(r["measured"])
    if r.get("plot"):
        lines += ["", f"picture: {r['plot']}"]
    if "recommendation" in r:  # last: it ends with the command that runs the choice
        lines += _recommendation_lines(r["recommendation"])
    return "\n".join(lines)
