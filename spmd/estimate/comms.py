"""What a planned step communicates: the collectives of one optimizer step (spmd.estimate.cost's
Setup) in the textbook form of its layout, and what each costs on the wire and in time.

Pure arithmetic on the layout (no JAX), as spmd.estimate.cost. One `Comm` per kind of
collective: the gradients' reduction and ZeRO's param gathers (`state_collectives`), tensor
parallelism's activation all-reduces, context parallelism's ring sends, an MoE's all-to-alls
(`expert_collectives`), a pipeline's stage sends, and DiLoCo's round-wise reduction
(`diloco_collectives`); `wire_bytes` and `comm_time` price one on a ring over the links of a
cost.Network. spmd.estimate.timing adds the times to the compute, spmd.estimate.summary prints
them, spmd.estimate.measure checks them against the compiled step. Units: bytes, seconds,
bytes per second.
"""

from __future__ import annotations

import dataclasses
import math

from spmd.estimate import experts, lora, volumes
from spmd.estimate.cost import Network, Setup, params_per_device
from spmd.estimate.pipeline_figures import pipeline_ticks


@dataclasses.dataclass(frozen=True)
class Comm:
    """One kind of collective a step runs. `bytes` is the op's result on one device for one
    execution (all-reduce: the buffer S; all-gather: the gathered array; reduce-scatter: the
    1/N shard; permute: the message), the convention of spmd.estimate.hlo. `hideable`: a
    data-parallel collective (gradient reduction, ZeRO gather) that can run behind compute;
    tensor-parallel and pipeline traffic sits on the critical path."""

    kind: str
    axes: tuple[str, ...]
    group: int  # devices in one group
    bytes: float
    count: float  # executions per optimizer step (1 / H: once per DiLoCo round)
    purpose: str
    hideable: bool = False


def collectives(s: Setup) -> list[Comm]:
    """The collectives of one optimizer step in the textbook form of each layout: the
    gradients' and params' (`state_collectives`), tensor parallelism's activation all-reduces
    (SP's all-gathers and reduce-scatters instead) and context parallelism's ring sends
    (spmd.estimate.long_sequence), an MoE's (`expert_collectives`) and a pipeline's.

    Megatron tp all-reduces the [b, t / cp, embed] activations A twice per block forward and
    twice backward, once more when remat replays a block and twice more when the pipeline
    recomputes it, plus two for the vocab-parallel embedding and head; per micro-batch, or
    in a pipeline per tick of its table over one chunk (`tensor_passes`). Pipelines send the
    residual stream forward and its gradient back every tick, all-reduce the embedding and
    head gradients (kept on every stage) over pipeline once, and interleaved ones move v > 1
    chunks of block params to their stages and their gradients back each step.
    """
    pipeline, tensor = s.mesh["pipeline"], s.mesh["tensor"]
    out = state_collectives(s)
    tokens = device_tokens(s)
    activation = activation_bytes(s)
    if tensor > 1:
        norm = s.shape.embed_dim / (s.sharded_fsdp if s.zero == 3 else 1) * s.bytes_of("grads")
        executions, layers = tensor_passes(s)
        norms = (s.shape.norms_per_block * layers + 1, norm)
        passes = (executions, layers, s.remat != "none", s.pipelined)
        # a pipeline's schedule differentiates the embedding, frozen or not (pipeline_stage)
        frozen_embedding = bool(s.lora_rank) and not s.pipelined
        traffic = volumes.tensor_traffic(
            activation, tokens, norms, tensor, s.sequence_parallel, passes,
            frozen_embedding=frozen_embedding,
        )  # fmt: skip
        out += [
            Comm(kind, ("tensor",), tensor, size, calls, purpose)
            for kind, size, calls, purpose in traffic
        ]
        if s.lora_rank:  # each adapter's low-rank partial sums
            size, calls = lora.tensor_traffic(s, executions, layers)
            out.append(Comm("all-reduce", ("tensor",), tensor, size, calls, "adapter activations"))
    out += context_collectives(s)
    out += expert_collectives(s)
    if s.pipelined:
        sends, sent = volumes.stage_sends(
            pipeline_ticks(s), activation, tensor, s.sequence_parallel
        )
        out.append(Comm("collective-permute", ("pipeline",), 2, sent, sends, "stage sends"))
        fsdp = s.sharded_fsdp
        local = params_per_device(s, fsdp_shards=False, experts=False)
        blocks = params_per_device(s, fsdp_shards=False, layers=True, experts=False)
        tables = (local - blocks) * s.bytes_of("grads") / (fsdp if s.zero >= 2 else 1)
        if not s.lora_rank:  # LoRA: the embedding and head are frozen, no gradients
            out.append(Comm("all-reduce", ("pipeline",), pipeline, tables, 1, "embed, head grads"))
        if s.virtual > 1:
            moved = blocks * (pipeline - 1) / pipeline / (fsdp if s.zero == 3 else 1)
            per_param = s.bytes_of("weights") + s.bytes_of("grads")
            out.append(Comm("collective-permute", ("pipeline",), 2, moved * per_param, 1, "chunks"))
    return diloco_collectives(s, out) if s.sync_every and s.mesh["data"] > 1 else out


def state_collectives(s: Setup) -> list[Comm]:
    """The gradients' reduction and ZeRO's param gathers. With P the bytes of the gradients
    one device holds after the tp/pp split (in the gradient dtype), W the same in the
    working-param dtype, F the fsdp size and n the micro-batches per step: DDP and ZeRO-1
    accumulate and all-reduce the gradients once per step (spmd.engine.accumulate); ZeRO-2
    and -3 reduce-scatter them (P/F per device) every micro-batch, so no whole gradient is
    ever held; with a data (expert, context) axis beside fsdp the shards are then all-reduced
    over it once. ZeRO-1 and -2 all-gather the updated params (W) once; ZeRO-3 all-gathers
    each block's params before its forward and again for its backward (and once more for the
    pipeline's recomputation), the embedding, head and final norm once. Under LoRA the
    gradients and updates are the adapters' alone (spmd.estimate.lora.state_traffic); ZeRO-3
    gathers the frozen base's blocks all the same, and the adapters with them."""
    mesh, n, fsdp = s.mesh, s.micro_steps, s.sharded_fsdp
    local = params_per_device(s, fsdp_shards=False, experts=False)
    blocks = params_per_device(s, fsdp_shards=False, layers=True, experts=False)
    grads, weights = local * s.bytes_of("grads"), local * s.bytes_of("weights")
    # the expert and context axes replicate the (other) params and average their gradients
    replicas = mesh["data"] * mesh.get("expert", 1) * s.context
    outer = tuple(a for a in ("data", "expert", "context") if mesh.get(a, 1) > 1)
    if s.lora_rank:
        out = [Comm(*row) for row in lora.state_traffic(s)]
        if fsdp == 1 or s.zero != 3:
            return out
    elif fsdp == 1:
        axes = tuple(a for a in ("data", "fsdp", "expert", "context") if mesh.get(a, 1) > 1)
        group = s.data_parallel * s.context
        return [Comm("all-reduce", axes, group, grads, 1, "gradients", True)] if group > 1 else []
    elif s.zero == 1:
        axes = (*outer[:1], "fsdp", *outer[1:])
        out = [Comm("all-reduce", axes, replicas * fsdp, grads, 1, "gradients", True)]
    else:
        out = [Comm("reduce-scatter", ("fsdp",), fsdp, grads / fsdp, n, "gradients", True)]
        if replicas > 1:
            out.append(Comm("all-reduce", outer, replicas, grads / fsdp, 1, "grad shards", True))
    if s.zero != 3:
        return out + [Comm("all-gather", ("fsdp",), fsdp, weights, 1, "updated params", True)]
    # all blocks' params, gathered as one; --fp8-all-gather sends them in e4m3 (1 byte; the
    # norms' few params and one fp32 scale per device and matrix left out: under 1%)
    gathered = blocks * (1 if s.fp8_all_gather else s.bytes_of("weights"))
    gathered += lora.gathered_bytes(s)
    gathers = volumes.param_gathers(n, 1, s.pipelined, prefetch=False)
    return out + [
        Comm("all-gather", ("fsdp",), fsdp, gathered, gathers, "block params", True),
        Comm(
            "all-gather",
            ("fsdp",),
            fsdp,
            weights - blocks * s.bytes_of("weights"),
            1,
            "embed, head",
            True,
        ),
    ]


def expert_collectives(s: Setup) -> list[Comm]:
    """An MoE's expert traffic: the token all-to-alls over the axes that split the experts
    (spmd.estimate.volumes.all_to_all, the formula theory checks against compiled HLO; on the
    critical path) and the all-reduce over data of the experts' gradients (replicated only
    there)."""
    if not s.shape.n_experts:
        return []
    out = []
    mesh = s.sharding_mesh
    exchanged = experts.exchange_dispatch(mesh, s.sequence_parallel, s.precision)
    moved = volumes.all_to_all(
        s.shape,
        mesh,
        s.batch,
        s.seq_len,
        s.micro_steps,
        s.remat != "none",
        s.bytes_of("compute"),
        exchanged,
    )
    if moved:
        axes = tuple(volumes.expert_axes(mesh))
        each = moved["bytes"] / moved["count"]
        out.append(Comm("all-to-all", axes, moved["group"], each, moved["count"], "tokens"))
    if mesh["data"] > 1:
        grads = params_per_device(s, fsdp_shards=False, experts=True) * s.bytes_of("grads")
        out.append(Comm("all-reduce", ("data",), mesh["data"], grads, 1, "expert grads", True))
    return out


def diloco_collectives(s: Setup, out: list[Comm]) -> list[Comm]:
    """`out` under --dcn-sync diloco (spmd.engine.diloco): the gradient reductions stay inside
    a replica (the data axis drops out of them), and once per round of `sync_every` steps one
    all-reduce over data of the fp32 params, sharded like the params, carries the
    pseudo-gradient."""
    data, kept = s.mesh["data"], []
    for c in out:
        if c.purpose in ("gradients", "grad shards", "expert grads") and "data" in c.axes:
            axes = tuple(a for a in c.axes if a != "data")
            if not axes:
                continue
            c = dataclasses.replace(c, axes=axes, group=c.group // data)
        kept.append(c)
    fp32 = params_per_device(s, fsdp_shards=s.zero == 3) * s.policy.itemsize("master")
    kept.append(Comm("all-reduce", ("data",), data, fp32, 1 / s.sync_every, "pseudo-gradient"))
    return kept


def wire_bytes(c: Comm) -> float:
    """Bytes one device sends per execution in a ring (all-reduce 2(N-1)/N * S; all-gather
    (N-1)/N * S of the gathered S; all-to-all (N-1)/N * S of its buffer S; reduce-scatter
    (N-1)/N * S of the input S = N x shard; permute S)."""
    full = c.bytes * c.group if c.kind == "reduce-scatter" else c.bytes
    if c.kind == "collective-permute":
        return full
    factor = 2 if c.kind == "all-reduce" else 1
    return factor * (c.group - 1) / c.group * full


def ring_time(kind: str, size: float, group: int, bandwidth: float, latency: float) -> float:
    """Seconds for one ring collective of `size` bytes (all-reduce buffer, all-gather result,
    reduce-scatter input, permute message) over `group` devices at `bandwidth` bytes/s with
    `latency` seconds per step: all-reduce 2(N-1)/N * S/B + 2(N-1)*alpha (a reduce-scatter then
    an all-gather); all-gather, reduce-scatter and all-to-all (N-1)/N * S/B + (N-1)*alpha;
    permute S/B + alpha."""
    if kind == "collective-permute":
        return size / bandwidth + latency
    if group <= 1:
        return 0.0
    steps = (2 if kind == "all-reduce" else 1) * (group - 1)
    return steps / group * size / bandwidth + steps * latency


def link_bandwidth(s: Setup, axes: tuple[str, ...], net: Network) -> float:
    """Bytes/s of a collective over `axes`: intra-node when the devices its group spans fit in
    a node. Mesh axes are laid out data, pipeline, fsdp, expert, context, tensor (tensor
    innermost), so a group spans the product of its outermost axis and every axis inside it."""
    order = ("data", "pipeline", "fsdp", "expert", "context", "tensor")
    outermost = min(order.index(a) for a in axes)
    span = math.prod(s.mesh.get(a, 1) for a in order[outermost:])
    return net.intra_bandwidth if span <= net.devices_per_node else net.inter_bandwidth


def comm_time(s: Setup, c: Comm, net: Network) -> float:
    """Seconds per optimizer step that collective `c` takes (executions x ring time)."""
    full = c.bytes * c.group if c.kind == "reduce-scatter" else c.bytes
    bandwidth = link_bandwidth(s, c.axes, net)
    return c.count * ring_time(c.kind, full, c.group, bandwidth, net.latency)


def tensor_passes(s: Setup) -> tuple[int, int]:
    """(executions per step, layers each) of the blocks' tensor-parallel collectives: each
    micro-batch over all layers; in a pipeline every tick over one chunk of a stage's layers,
    since the stages run the table's slots in lockstep and an idle stage's collectives ride
    the bubble (spmd.parallel.pipeline_stage), as the ring's sends do."""
    if not s.pipelined:
        return s.micro_steps, s.shape.n_layers
    return pipeline_ticks(s), s.shape.n_layers // (s.mesh["pipeline"] * s.virtual)


def device_tokens(s: Setup) -> float:
    """Tokens of one micro-batch on one device: micro-batch x length / cp."""
    return s.micro_batch * s.seq_len / s.context


def activation_bytes(s: Setup) -> float:
    """Bytes of one device's [micro-batch, length / cp, embed] residual-stream activation in the
    compute dtype: what a tensor-parallel all-reduce or a pipeline send moves."""
    return device_tokens(s) * s.shape.embed_dim * s.bytes_of("compute")


def context_collectives(s: Setup) -> list[Comm]:
    """Context parallelism's attention traffic (none at cp = 1): the ring's key and value
    sends (`ring_traffic`), or under --cp-mode ulysses its all-to-alls of q, k, v and the
    output, 4 per micro-batch, layer of the stage and pass (the ring's passes), each the
    average of the four's result bytes (spmd.estimate.volumes.ulysses_layer_bytes)."""
    if s.context == 1:
        return []
    if s.cp_mode != "ulysses":
        block, sends = ring_traffic(s)
        return [Comm("collective-permute", ("context",), s.context, block, sends, "ring k, v")]
    per_layer = volumes.ulysses_layer_bytes(
        s.shape, s.micro_batch, s.seq_len, s.context, s.mesh["tensor"], s.bytes_of("compute")
    )
    layers = s.shape.n_layers // s.mesh["pipeline"]
    calls = s.micro_steps * layers * volumes.ring_passes(s.remat != "none", s.pipelined)
    purpose = "ulysses q, k, v, out"
    return [Comm("all-to-all", ("context",), s.context, per_layer / 4, 4 * calls, purpose)]


def ring_traffic(s: Setup) -> tuple[float, int]:
    """(bytes per send, sends per step) of ring attention in planned step `s`: per micro-batch,
    layer of the stage and pass a key and a value block to the next device cp − 1 times
    (spmd.estimate.volumes); (0, 0) at cp = 1."""
    context = s.mesh.get("context", 1)
    if context == 1:
        return 0.0, 0
    block = volumes.kv_block_bytes(
        s.shape, s.micro_batch, s.seq_len, context, s.mesh["tensor"], s.bytes_of("compute")
    )
    layers = s.shape.n_layers // s.mesh["pipeline"]
    passes = volumes.ring_passes(s.remat != "none", s.pipelined)
    return block, volumes.ring_sends(context, layers, passes, s.micro_steps)
