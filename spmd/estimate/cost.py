"""Analytic cost model of one training step: memory per device, communication, compute.

Pure arithmetic on a model shape and a layout (no JAX); `python -m spmd.plan` prints it and
checks it against the compiled step. Units everywhere: sizes in bytes, times in seconds,
bandwidths in bytes per second, compute in FLOP/s. GB means 1e9 bytes.

A layout is a mesh {data, pipeline, fsdp, tensor} -> size plus the ZeRO stage of the fsdp axis
(spmd.parallel.rules): stage 1 shards optimizer state over fsdp, 2 also gradients, 3 also params;
the
data axis always replicates. Stage 0 is plain DDP: the fsdp devices then replicate too.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Protocol

from spmd.errors import UsageError


class ModelShape(Protocol):
    """The Llama architecture fields the model needs (models.llama.LlamaConfig has them)."""

    vocab_size: int
    embed_dim: int
    mlp_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    tie_embeddings: bool
    remat: str


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per parameter or activation element of a dtype policy."""

    weights: int  # the params the step reads
    grads: int
    master: int  # an extra fp32 copy of the params kept with the optimizer state (0: none)
    compute: int  # activations


# fp32/bf16/fp16 are the engine's policies (params and optimizer state stay fp32; bf16/fp16
# only change the compute dtype). "mixed" is the textbook mixed-precision recipe of the ZeRO
# paper: bf16 params and grads, an fp32 master copy with the optimizer state.
PRECISIONS = {
    "fp32": Precision(weights=4, grads=4, master=0, compute=4),
    "bf16": Precision(weights=4, grads=4, master=0, compute=2),
    "fp16": Precision(weights=4, grads=4, master=0, compute=2),
    "mixed": Precision(weights=2, grads=2, master=4, compute=2),
}
# Optimizer state bytes per parameter besides any master copy (fp32 moments).
OPTIMIZERS = {"adamw": 8, "momentum": 4, "sgd": 0}
REMATS = ("none", "full", "dots_saveable")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One planned run: model, layout, dtype policy and batch."""

    shape: Any  # a ModelShape
    n_params: float  # parameters (scalars); may differ from the shape's count (--params)
    mesh: dict[str, int]  # data, pipeline, fsdp, tensor -> devices along the axis
    zero: int  # 0 (DDP), 1, 2 or 3
    precision: str  # a key of PRECISIONS
    optimizer: str  # a key of OPTIMIZERS
    batch: int  # global batch, sequences per optimizer step
    seq_len: int  # tokens per sequence
    accum: int  # micro-batches per optimizer step

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def sharded_fsdp(self) -> int:
        """Ways the fsdp axis shards state (1 under ZeRO 0, where it only replicates)."""
        return self.mesh["fsdp"] if self.zero > 0 else 1

    @property
    def data_parallel(self) -> int:
        """Ways the batch is split: data x fsdp."""
        return self.mesh["data"] * self.mesh["fsdp"]

    @property
    def micro_batch(self) -> int:
        """Sequences per device per micro-batch."""
        return self.batch // (self.data_parallel * self.accum)


@dataclasses.dataclass(frozen=True)
class Network:
    """Links between devices: bytes/s per device inside a node and across nodes, seconds of
    latency per ring step, devices per node."""

    intra_bandwidth: float
    inter_bandwidth: float
    latency: float
    devices_per_node: int


@dataclasses.dataclass(frozen=True)
class Comm:
    """One kind of collective a step runs. `bytes` is the op's result on one device for one
    execution (all-reduce: the buffer S; all-gather: the gathered array; reduce-scatter: the
    1/N shard; permute: the message), the convention of spmd.estimate.hlo."""

    kind: str
    axes: tuple[str, ...]
    group: int  # devices in one group
    bytes: float
    count: int  # executions per optimizer step
    purpose: str


def check_setup(s: Setup) -> None:
    """UsageError when a value is out of range or a mesh axis does not divide what it splits."""
    if s.precision not in PRECISIONS:
        raise UsageError(f"--precision {s.precision!r} is not one of {', '.join(PRECISIONS)}")
    if s.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer {s.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if s.zero not in (0, 1, 2, 3):
        raise UsageError(f"--zero {s.zero} is not a ZeRO stage; use 0 (DDP), 1, 2 or 3")
    if s.shape.remat not in REMATS:
        raise UsageError(f"--remat {s.shape.remat!r} is not one of {', '.join(REMATS)}")
    ways = s.data_parallel * s.accum
    if s.batch < 1 or s.batch % ways:
        raise UsageError(
            f"--batch {s.batch} is not divisible by data-parallel size {s.data_parallel} x "
            f"accum {s.accum} = {ways}; use a multiple of {ways}"
        )
    tensor, pipeline, fsdp = s.mesh["tensor"], s.mesh["pipeline"], s.sharded_fsdp
    splits = [(tensor, "tp", "n_heads"), (tensor, "tp", "n_kv_heads"), (tensor, "tp", "mlp_dim")]
    splits += [(tensor, "tp", "vocab_size"), (pipeline, "pp", "n_layers")]
    splits += [(fsdp, "fsdp", "embed_dim")]
    for ways, axis, field in splits:
        size = getattr(s.shape, field)
        if size % ways:
            good = ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)
            raise UsageError(f"--mesh {axis}={ways} does not divide {field}={size}; use {good}")


# --- memory -------------------------------------------------------------------------------


def param_groups(shape: ModelShape) -> list[tuple[int, tuple[str, ...]]]:
    """(parameter count, mesh axes other than fsdp that split it) for each kind of param,
    following spmd.parallel.rules: matrices split over tensor, stacked layers over pipeline. Every
    param
    has an `embed` dim, which ZeRO shards over fsdp. The counts add up to n_params()."""
    e, layers = shape.embed_dim, shape.n_layers
    attention = e * shape.head_dim * (2 * shape.n_heads + 2 * shape.n_kv_heads)
    tables = shape.vocab_size * e * (1 if shape.tie_embeddings else 2)
    return [
        (layers * (attention + 3 * e * shape.mlp_dim), ("tensor", "pipeline")),
        (layers * 2 * e, ("pipeline",)),  # the two RMSNorm scales of each block
        (tables, ("tensor",)),  # embedding and output head: vocab over tensor
        (e, ()),  # final norm
    ]


def shape_params(shape: ModelShape) -> int:
    """Parameter count of a shape (scalars)."""
    return sum(count for count, _ in param_groups(shape))


def params_per_device(s: Setup, fsdp_shards: bool, layers: bool | None = None) -> float:
    """Parameters one device holds (scalars); `fsdp_shards`: the role is sharded over fsdp.
    `layers` True counts only the stacked block params, False only the others, None all."""
    scale = s.n_params / shape_params(s.shape)
    fsdp = s.sharded_fsdp if fsdp_shards else 1
    return sum(
        count * scale / (math.prod(s.mesh[a] for a in axes) * fsdp)
        for count, axes in param_groups(s.shape)
        if layers is None or layers == ("pipeline" in axes)
    )


def bytes_per_param(s: Setup) -> dict[str, int]:
    """Unsharded bytes per parameter: weights, grads, optimizer (master copy + moments)."""
    p = PRECISIONS[s.precision]
    return {"params": p.weights, "grads": p.grads, "optimizer": p.master + OPTIMIZERS[s.optimizer]}


def model_state_bytes(s: Setup) -> dict[str, float]:
    """Bytes per device of params, grads and optimizer state and their sum ("model_state")."""
    per_param = bytes_per_param(s)
    out = {
        role: per_param[role] * params_per_device(s, s.zero >= stage)
        for role, stage in (("params", 3), ("grads", 2), ("optimizer", 1))
    }
    out["model_state"] = sum(out.values())
    return out


def activation_bytes(s: Setup) -> float:
    """Peak bytes of activations kept for the backward pass on one device.

    Per layer and micro-batch of b sequences of length t (per device: heads h, kv heads k,
    mlp width m divided by tensor; embed e and head_dim d whole), in elements:
      no remat: b*t*(4e + (h + 2k)*d + h*d + 4m) + b*h*t*t
        (block input, its two norms' inputs/outputs; q, k, v; attention output; gate, up,
        silu(gate), their product; the softmax probabilities of every head)
      remat "full": b*t*e (the block input only), plus one block's no-remat set while it is
        recomputed in the backward pass;
      remat "dots_saveable": b*t*(3e + (h + 2k)*d + 2m) (the matmul outputs), plus the same.
    Times the compute dtype's bytes, for the n_layers/pp layers of a stage. Outside the blocks:
    the embedding output and final norm (2*b*t*e in the compute dtype) and the fp32 logits and
    their softmax (2*b*t*vocab/tp*4 bytes). With pp > 1 a stage holds all `accum`
    micro-batches at once (GPipe); otherwise one micro-batch is live at a time.
    """
    shape, tensor = s.shape, s.mesh["tensor"]
    b, t, e, d = s.micro_batch, s.seq_len, shape.embed_dim, shape.head_dim
    h, k, m = shape.n_heads / tensor, shape.n_kv_heads / tensor, shape.mlp_dim / tensor
    full = b * t * (4 * e + (h + 2 * k) * d + h * d + 4 * m) + b * h * t * t
    kept = {
        "none": full,
        "full": b * t * e,
        "dots_saveable": b * t * (3 * e + (h + 2 * k) * d + 2 * m),
    }
    recompute = 0 if shape.remat == "none" else full
    c = PRECISIONS[s.precision].compute
    stage_layers = shape.n_layers // s.mesh["pipeline"]
    outside = 2 * b * t * e * c + 2 * b * t * shape.vocab_size / tensor * 4
    in_flight = s.accum if s.mesh["pipeline"] > 1 else 1
    return in_flight * (stage_layers * kept[shape.remat] * c + outside) + recompute * c


def memory(s: Setup, overhead: float, hbm: float) -> dict[str, Any]:
    """Per-device bytes: params, grads, optimizer, model_state (their sum), activations,
    overhead, total, hbm, headroom (hbm - total) and fits (total <= hbm)."""
    out: dict[str, Any] = model_state_bytes(s)
    out["activations"] = activation_bytes(s)
    out["overhead"] = overhead
    out["total"] = out["model_state"] + out["activations"] + overhead
    out.update(hbm=hbm, headroom=hbm - out["total"], fits=out["total"] <= hbm)
    return out


# --- communication ------------------------------------------------------------------------


def collectives(s: Setup) -> list[Comm]:
    """The collectives of one optimizer step in the textbook form of each layout.

    With P the bytes of the params one device holds after the tp/pp split and F the fsdp size:
    DDP all-reduces the grads (P) every micro-batch; ZeRO-1 too, then all-gathers the updated
    params; ZeRO-2 reduce-scatters the grads (P/F per device) every micro-batch and all-gathers
    the params after the update; ZeRO-3 all-gathers each block's params before its forward
    and again before its backward in every micro-batch (the embedding, head and final norm,
    used outside the scanned blocks, are gathered once per step and kept) and reduce-scatters
    the grads. With a data axis beside fsdp, the grad shards are then all-reduced over data.
    Megatron tp all-reduces the [b, t, embed] activations A twice per block in the forward and
    twice in the backward (twice more when remat replays the forward), plus two for the
    vocab-parallel embedding and head; pipeline stages send A forward and its gradient back
    per micro-batch.
    """
    mesh, p, n = s.mesh, PRECISIONS[s.precision], s.accum
    data, fsdp, tensor, pipeline = mesh["data"], s.sharded_fsdp, mesh["tensor"], mesh["pipeline"]
    local = params_per_device(s, fsdp_shards=False)
    grads, weights = local * p.grads, local * p.weights
    out = []
    if fsdp == 1:
        batch_axes = tuple(a for a in ("data", "fsdp") if mesh[a] > 1)
        dp = s.data_parallel
        if dp > 1:
            out.append(Comm("all-reduce", batch_axes, dp, grads, n, "gradients"))
    else:
        if s.zero == 1:
            axes = ("data", "fsdp") if data > 1 else ("fsdp",)
            out.append(Comm("all-reduce", axes, data * fsdp, grads, n, "gradients"))
        else:
            out.append(Comm("reduce-scatter", ("fsdp",), fsdp, grads / fsdp, n, "gradients"))
            if data > 1:
                out.append(Comm("all-reduce", ("data",), data, grads / fsdp, n, "grad shards"))
        if s.zero == 3:
            blocks = params_per_device(s, fsdp_shards=False, layers=True) * p.weights
            out.append(Comm("all-gather", ("fsdp",), fsdp, blocks, 2 * n, "block params fwd+bwd"))
            out.append(Comm("all-gather", ("fsdp",), fsdp, weights - blocks, 1, "embed, head"))
        else:
            out.append(Comm("all-gather", ("fsdp",), fsdp, weights, 1, "updated params"))
    activation = s.micro_batch * s.seq_len * s.shape.embed_dim * p.compute
    stage_layers = s.shape.n_layers // pipeline
    if tensor > 1:
        per_block = 6 if s.shape.remat == "full" else 4
        count = n * (per_block * stage_layers + 2)
        out.append(Comm("all-reduce", ("tensor",), tensor, activation, count, "activations"))
    if pipeline > 1:
        out.append(
            Comm("collective-permute", ("pipeline",), 2, activation, 2 * n, "stage boundary")
        )
    return out


def wire_bytes(c: Comm) -> float:
    """Bytes one device sends per execution in a ring (all-reduce 2(N-1)/N * S; all-gather
    (N-1)/N * S of the gathered S; reduce-scatter (N-1)/N * S of the input S = N x shard;
    permute S)."""
    full = c.bytes * c.group if c.kind == "reduce-scatter" else c.bytes
    if c.kind == "collective-permute":
        return full
    factor = 2 if c.kind == "all-reduce" else 1
    return factor * (c.group - 1) / c.group * full


def ring_time(kind: str, size: float, group: int, bandwidth: float, latency: float) -> float:
    """Seconds for one ring collective of `size` bytes (all-reduce buffer, all-gather result,
    reduce-scatter input, permute message) over `group` devices at `bandwidth` bytes/s with
    `latency` seconds per step: all-reduce 2(N-1)/N * S/B + 2(N-1)*alpha (a reduce-scatter then
    an all-gather); all-gather and reduce-scatter (N-1)/N * S/B + (N-1)*alpha; permute S/B +
    alpha."""
    if kind == "collective-permute":
        return size / bandwidth + latency
    if group <= 1:
        return 0.0
    steps = (2 if kind == "all-reduce" else 1) * (group - 1)
    return steps / group * size / bandwidth + steps * latency


def link_bandwidth(s: Setup, axes: tuple[str, ...], net: Network) -> float:
    """Bytes/s of a collective over `axes`: intra-node when the devices its group spans fit in
    a node. Mesh axes are laid out data, pipeline, fsdp, tensor (tensor innermost), so a group
    spans the product of its outermost axis and every axis inside it."""
    order = ("data", "pipeline", "fsdp", "tensor")
    outermost = min(order.index(a) for a in axes)
    span = math.prod(s.mesh[a] for a in order[outermost:])
    return net.intra_bandwidth if span <= net.devices_per_node else net.inter_bandwidth


def comm_time(s: Setup, c: Comm, net: Network) -> float:
    """Seconds per optimizer step that collective `c` takes (executions x ring time)."""
    full = c.bytes * c.group if c.kind == "reduce-scatter" else c.bytes
    bandwidth = link_bandwidth(s, c.axes, net)
    return c.count * ring_time(c.kind, full, c.group, bandwidth, net.latency)


# --- compute and batch --------------------------------------------------------------------


def flops_per_step(s: Setup) -> float:
    """Training FLOPs of one optimizer step over all devices: per token 2 x (matmul params) +
    4 x layers x seq_len x heads x head_dim (attention scores and values) in the forward,
    times 3 for forward + backward, 4 with full remat (the forward runs twice)."""
    shape = s.shape
    block_matrices = param_groups(shape)[0][0]
    matmul = (
        (block_matrices + shape.vocab_size * shape.embed_dim) * s.n_params / shape_params(shape)
    )
    attention = 4 * shape.n_layers * s.seq_len * shape.n_heads * shape.head_dim
    passes = 4 if shape.remat == "full" else 3
    return passes * s.batch * s.seq_len * (2 * matmul + attention)


def compute_time(s: Setup, flops_per_device: float) -> float:
    """Seconds of compute per optimizer step at `flops_per_device` FLOP/s each, work split
    evenly over devices; a pipeline adds its bubble: x (M + pp - 1) / M with M = accum."""
    pipeline = s.mesh["pipeline"]
    bubble = (s.accum + pipeline - 1) / s.accum
    return flops_per_step(s) / s.devices / flops_per_device * bubble


def global_batch(micro_batch: int, data_parallel: int, accum: int) -> int:
    """Sequences per optimizer step: per-device micro-batch x data-parallel size x accum."""
    return micro_batch * data_parallel * accum


def llama_shape(n_params: float) -> dict[str, Any]:
    """A Llama-like shape of about `n_params` parameters, for planning a raw size: vocab
    32000, head_dim 128, embed_dim 256, 512, 768 or a multiple of 1024, n_layers = n_heads =
    n_kv_heads = embed_dim / 128 (about Llama 2's aspect ratio), mlp_dim = 8/3 x embed_dim
    rounded to a multiple of 256. The embed_dim whose count is nearest is chosen."""

    def shape(width: int) -> dict[str, Any]:
        heads = width // 128
        mlp = max(256, round(8 * width / 3 / 256) * 256)
        return dict(
            vocab_size=32000,
            embed_dim=width,
            mlp_dim=mlp,
            n_layers=heads,
            n_heads=heads,
            n_kv_heads=heads,
            head_dim=128,
            tie_embeddings=False,
        )

    def count(width: int) -> float:
        return shape_params(types.SimpleNamespace(**shape(width)))

    widths = [256, 512, 768, *range(1024, 65537, 1024)]  # heads divisible by 8 from 1024 on
    best = min(widths, key=lambda w: abs(math.log(count(w) / n_params)))
    return shape(best)
