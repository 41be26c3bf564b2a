"""Recommend a layout: run spmd.estimate.search, say why its choice won in a few lines, list
the runner-ups with their estimated times, and write the `python -m spmd.train` command that
runs it. Units: bytes, seconds; GB = 1e9 bytes.
"""

from __future__ import annotations

import dataclasses

from spmd.estimate import comms, cost, lora, memory, pipeline_figures, search
from spmd.estimate.units import ms
from spmd.parallel.mesh import format_mesh

RUNNER_UPS = 4


@dataclasses.dataclass(frozen=True)
class Recommendation:
    best: search.Scored
    reasons: list[str]
    considered: int  # valid candidates
    fitting: int  # of those, the ones that fit in memory
    runner_ups: list[search.Scored]  # the best of the next distinct structures, fastest first

    def as_dict(self, model_args: list[str]) -> dict:
        """Plain JSON values, with the `python -m spmd.train` command line that runs the
        choice (`model_args`: the flags that build the model)."""
        best = self.best

        def per_sequence(c: search.Scored) -> float:
            return c.step_s / c.setup.batch

        return {
            "mesh_text": format_mesh(best.setup.mesh),
            "zero": best.setup.zero,
            "label": best.label(),
            "reasons": self.reasons,
            "considered": self.considered,
            "fitting": self.fitting,
            "runner_ups": [
                {
                    "label": c.label(),
                    "mesh_text": format_mesh(c.setup.mesh),
                    "zero": c.setup.zero,
                    "step_time_s": c.step_s,
                    "slower": per_sequence(c) / per_sequence(best) - 1,
                    "overhead_ratio": c.overhead_ratio,
                    "total_bytes_per_device": round(c.memory["total"]),
                }
                for c in self.runner_ups
            ],
            "train_command": " ".join(
                ["python -m spmd.train", *model_args, *train_flags(best.setup)]
            ),
        }


def recommend(base: cost.Setup, space: search.Space, cluster: search.Cluster) -> Recommendation:
    """The fastest fitting candidate of base.devices devices for base's model, with reasons;
    if nothing fits, the one needing the least memory (its memory["fits"] is False)."""
    result = search.search(base, space, cluster)
    if result.ranked:
        best, *others = search.distinct_layouts(result.ranked, RUNNER_UPS + 1)
        others.sort(key=lambda c: c.step_s / c.setup.batch)
    else:
        best, others = result.smallest, []
    lines = reasons(best, result, cluster)
    return Recommendation(best, lines, result.considered, len(result.ranked), others)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def reasons(best: search.Scored, result: search.Result, cluster: search.Cluster) -> list[str]:
    """Short lines saying why `best` was chosen."""
    s, mem, net = best.setup, best.memory, cluster.net
    mesh, lines = s.mesh, []
    ddp = dataclasses.replace(s, mesh={**dict.fromkeys(mesh, 1), "data": s.devices}, zero=0)
    state = memory.model_state_bytes(ddp)["model_state"] + cluster.overhead
    per_param = memory.bytes_per_param(s)
    kept = f"{sum(per_param.values()):g} B/param"
    if s.lora_rank:  # a frozen base (its params only) and the adapters' whole state
        kept = lora.state_words(per_param, lora.adapter_params(s), s.lora_base_dtype)
    verdict = "over" if state > mem["hbm"] else "within"
    lines.append(
        f"plain DDP keeps {kept} on every device: {_gb(state)} with the overhead, "
        f"{verdict} the {_gb(mem['hbm'])} of HBM"
    )
    lines += _mesh_lines(best, net)
    lines.append(_cut_line(best, cluster))
    verdict = "fits" if mem["fits"] else "does NOT fit"
    lines.append(
        f"memory: {_gb(mem['total'])} of {_gb(mem['hbm'])} per device {verdict}, headroom "
        f"{_gb(mem['headroom'])}"
    )
    if s.offload != "none":
        on_devices = dataclasses.replace(s, offload="none")
        lines.append(
            f"--offload {s.offload}: nothing fits with the state on the devices (this layout "
            f"would need {_gb(cluster.memory(on_devices)['total'])}); {_gb(mem['host_state'])} "
            f"per device in host memory, {_gb(mem['host_per_node'])} of the node's "
            f"{_gb(mem['host_memory'])}"
        )
    if not mem["fits"]:
        lines.append(
            f"none of the {result.considered} candidates (mesh x ZeRO x micro-batch x remat x "
            f"schedule) fits; this one needs the least memory: add devices or HBM"
        )
        return lines
    t = best.time
    host = f" + host transfers {ms(t['host'])}" if t["host"] else ""
    lines.append(
        f"step {ms(t['step'])} = compute {ms(t['compute'])} + exposed communication "
        f"{ms(t['exposed'])} + bubble {ms(t['bubble'])}{host} ({best.overhead_ratio:.0%} over "
        f"compute): the fastest of {len(result.ranked)} fitting candidates"
    )
    return lines


def _mesh_lines(best: search.Scored, net: cost.Network) -> list[str]:
    s = best.setup
    mesh, lines = s.mesh, []
    planned = comms.collectives(s)
    if mesh["tensor"] > 1:
        tp = [c for c in planned if c.axes == ("tensor",)]
        seconds = sum(comms.comm_time(s, c, net) for c in tp)
        what = "all-gathers + reduce-scatters (SP)" if s.sequence_parallel else "all-reduces"
        lines.append(
            f"tp={mesh['tensor']} inside a node of {net.devices_per_node}: its "
            f"{sum(c.count for c in tp):g} activation {what} per step ({ms(seconds)}) use the "
            f"{net.intra_bandwidth / 1e9:g} GB/s links"
        )
    if s.context > 1:
        crossing = comms.context_collectives(s)  # the ring's sends or Ulysses' all-to-alls
        seconds = sum(comms.comm_time(s, c, net) for c in crossing)
        count = sum(c.count for c in crossing)
        what = (
            f"Ulysses' {count:g} all-to-alls of q, k, v and the output"
            if s.cp_mode == "ulysses"
            else f"ring attention's {count:g} key/value sends"
        )
        lines.append(
            f"cp={s.context}: each device holds {s.seq_len // s.context} of the {s.seq_len} "
            f"tokens of a sequence; {what} per step take {ms(seconds)}"
        )
    if s.pipelined:
        chunks = f", {s.virtual} chunks per stage" if s.virtual > 1 else ""
        lines.append(
            f"pp={mesh['pipeline']}: stages of {s.shape.n_layers // mesh['pipeline']} of the "
            f"{s.shape.n_layers} layers, {s.schedule}{chunks} over {s.micro_steps} micro-batches: "
            f"bubble {pipeline_figures.bubble_share(s):.1%} of the step"
        )
    lines += _expert_lines(s, planned, net)
    if mesh["fsdp"] > 1:
        what = {1: "optimizer state", 2: "gradients and optimizer state"}.get(
            s.zero, "params, gradients and optimizer state"
        )
        lines.append(f"fsdp={mesh['fsdp']} with ZeRO-{s.zero}: {what} split {mesh['fsdp']} ways")
    if mesh["data"] > 1:
        ways = (mesh["fsdp"] if s.zero >= 2 else 1) * mesh["tensor"] * mesh["pipeline"]
        grads = "adapters' gradients" if s.lora_rank else "gradients"  # LoRA: the base's none
        share = f"1/{ways} of the {grads}" if ways > 1 else f"all the {grads}"
        lines.append(f"dp={mesh['data']}: replicas that all-reduce {share} each holds")
    return lines


def _expert_lines(s: cost.Setup, planned: list[comms.Comm], net: cost.Network) -> list[str]:
    """Where an MoE's experts are split (ep x fsdp > 1): how, and what their all-to-alls cost."""
    split = s.mesh.get("expert", 1) * s.sharded_fsdp
    if not s.shape.n_experts or split == 1:
        return []
    axes = " x ".join(a for a in ("fsdp", "expert") if s.sharding_mesh.get(a, 1) > 1)
    moved = [c for c in planned if c.kind == "all-to-all"]
    seconds = sum(comms.comm_time(s, c, net) for c in moved)
    return [
        f"experts: the {s.shape.n_experts} of each layer split {split} ways over {axes}, "
        f"{s.shape.n_experts // split} per device; the tokens' {sum(c.count for c in moved):g} "
        f"all-to-alls per step take {ms(seconds)}, not hidden"
    ]


def _cut_line(best: search.Scored, cluster: search.Cluster) -> str:
    """The micro-batch and remat, and what the cheaper remat policies would need."""
    s = best.setup
    steps = f"M={s.micro_steps} pipeline micro-batches" if s.pipelined else f"accum {s.accum}"
    line = (
        f"micro-batch {s.micro_batch} per device x data-parallel {s.data_parallel} x {steps} "
        f"= batch {s.batch} of {s.seq_len} tokens; remat {s.remat}"
    )
    needs = []
    for remat in cost.REMATS[: cost.REMATS.index(s.remat)]:
        cheaper = dataclasses.replace(s, remat=remat)
        needs.append(f"{remat} would need {_gb(cluster.memory(cheaper)['total'])}")
    return line + (f" ({', '.join(needs)})" if needs else "")


def train_flags(s: cost.Setup) -> list[str]:
    """The `python -m spmd.train` flags (besides the model's) that run layout `s`."""
    flags = ["--mesh", format_mesh(s.mesh), "--zero", str(s.zero)]  # 0: plain DDP, as in train
    if s.offload != "none":
        flags += ["--offload", s.offload]
    if s.sequence_parallel:
        flags += ["--sequence-parallel"]
    if s.context > 1 and s.cp_mode == "ulysses":
        flags += ["--cp-mode", "ulysses"]
    flags += ["--batch", str(s.batch), "--seq-len", str(s.seq_len)]
    if s.accum > 1:
        flags += ["--accum", str(s.accum)]
    if s.pipelined:
        flags += ["--pp-schedule", s.schedule, "--microbatches", str(s.microbatches)]
        if s.virtual > 1:
            flags += ["--pp-virtual", str(s.virtual)]
    flags += ["--precision", s.precision]
    if s.grad_reduce:
        flags += ["--grad-reduce", s.grad_reduce]
    return flags + ["--remat", s.remat]
