"""Analytic cost model of one training step, its ground: the planned step (`Setup`: the layout,
dtypes, batch and how the step is cut), the links it runs on (`Network`), the checks a plan
must pass and the params each device holds.

Pure arithmetic on a model shape and a layout (no JAX). spmd.estimate.comms adds what the step
communicates, spmd.estimate.timing how long it takes, spmd.estimate.memory the bytes per
device; spmd.estimate.search ranks layouts with them, `python -m spmd.plan` prints them and
checks them against the compiled step. Units everywhere: sizes in bytes, times in seconds,
bandwidths in bytes per second, compute in FLOP/s. GB means 1e9 bytes.

A layout is a mesh {data, pipeline, fsdp, tensor} -> size plus the ZeRO stage of the fsdp axis
(spmd.parallel.rules): stage 1 shards the optimizer state (fp32 master + moments) over fsdp, 2
also the gradients, 3 also the params; the data axis always replicates. Stage 0 is plain DDP:
the fsdp devices then replicate too. How a step is cut is part of the layout: `accum`
micro-batches, and with pp > 1 `microbatches` pipeline micro-batches per accumulation step,
all run by one schedule (spmd.parallel.pipeline.with_accumulation); the remat policy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection

from spmd.engine import offload as engine_offload
from spmd.engine import optimizers, precision
from spmd.engine.precision import Policy  # the Setup field `precision` shadows the module
from spmd.errors import UsageError
from spmd.estimate import long_sequence
from spmd.estimate.shape import EXPERT_AXES, NO_FSDP, param_groups, shape_params
from spmd.model_shape import REMATS, ModelShape
from spmd.parallel import schedules

# The dtypes of --precision are spmd.engine.precision's policies: bf16 / fp16 are the ZeRO
# paper's mixed precision (16-bit params and grads, fp32 master weights with the Adam moments:
# 2 + 2 + 12 = 16 bytes per param); fp32 keeps one copy. The optimizer's state per param
# beside the master copy is its registry entry's (spmd.engine.optimizers: AdamW's 2 moments).
# cheapest compute first; offload (dots_saveable's outputs in host memory, their transfers
# in the step time: spmd.estimate.offload) last
# --offload: the state kept in host memory between steps (spmd.engine.offload)
OFFLOADS = engine_offload.OFFLOADS
# --cp-mode as the Layout holds it (spmd.parallel.layout; the run's auto is the ring)
CP_MODES = ("ring", "ulysses")
SEARCHED_REMATS = REMATS  # --remat offload in the search's host pass (spmd.estimate.search)


@dataclasses.dataclass(frozen=True)
class Setup:
    """One planned run: model, layout, dtype policy, batch and how the step is cut."""

    shape: ModelShape
    n_params: float  # parameters (scalars); may differ from the shape's count (--params)
    mesh: dict[str, int]  # data, pipeline, fsdp, tensor -> devices along the axis
    zero: int  # 0 (DDP), 1, 2 or 3
    precision: str  # a --precision policy (spmd.engine.precision.POLICIES)
    optimizer: str  # a name in spmd.engine.optimizers.OPTIMIZERS
    batch: int  # global batch, sequences per optimizer step
    seq_len: int  # tokens per sequence
    accum: int = 1  # accumulation micro-steps per optimizer step
    remat: str = "none"  # what the backward pass keeps: a key of REMATS
    grad_reduce: str = ""  # gradient dtype ("" = the compute dtype)
    schedule: str = "1f1b"  # pipeline schedule (pp > 1)
    microbatches: int = 1  # pipeline micro-batches per accumulation micro-step (pp > 1)
    virtual: int = 1  # chunks per stage (interleaved)
    sync_every: int = 0  # --dcn-sync diloco: steps per round (0: gradients reduced every step)
    sequence_parallel: bool = False  # Megatron-SP: the residual stream split over tensor too
    offload: str = "none"  # --offload: none, optimizer or params kept in host memory
    # LoRA (spmd.estimate.lora): the adapters' rank (0: full fine-tuning) and target names;
    # the base is then frozen: no gradients, master or optimizer state of its own
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    # the frozen base's storage: "" the working dtype, "nf4" 4-bit codes, "int8" 8-bit codes
    lora_base_dtype: str = ""
    fp8_all_gather: bool = False  # ZeRO-3 gathers the blocks' params in e4m3 (--precision fp8)
    # how attention crosses the context split (cp > 1; --cp-mode): ring (key / value blocks
    # passed round) or ulysses (all-to-alls to whole sequences of heads / cp heads each)
    cp_mode: str = "ring"
    # --optimizer adafactor: the smaller side from which a matrix's second moment is factored
    adafactor_min_dim: int = 128
    # --objective (spmd.engine.objectives): DPO runs a reference forward (no backward) per
    # step, on LoRA's frozen base or, in a full fine-tune, on a frozen copy of the params
    objective: str = "next_token"
    # --dpo-precompute-reference: the reference's log-probs come with the data, so the step
    # runs no reference forward and holds no copy
    reference_precomputed: bool = False

    @property
    def reference_forward(self) -> bool:
        """Whether each step runs a reference model's forward too (DPO)."""
        from spmd.engine import objectives

        reads = objectives.get(self.objective).reference is not None
        return reads and not self.reference_precomputed

    @property
    def reference_copy(self) -> bool:
        """Whether the reference is a frozen copy of the params (a full fine-tune's DPO,
        --dpo-reference) rather than LoRA's own base."""
        return self.reference_forward and not self.lora_rank

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def sharded_fsdp(self) -> int:
        """Ways the fsdp axis shards state (1 under ZeRO 0, where it only replicates)."""
        return self.mesh["fsdp"] if self.zero > 0 else 1

    @property
    def data_parallel(self) -> int:
        """Ways the batch is split: data x fsdp x expert (the expert devices split the tokens
        too; 1 without experts)."""
        return self.mesh["data"] * self.mesh["fsdp"] * self.mesh.get("expert", 1)

    @property
    def sharding_mesh(self) -> dict[str, int]:
        """The mesh as the state's shardings see it: under ZeRO 0 the fsdp devices only
        replicate, so they count as `data` (as the engine builds it)."""
        if self.zero or self.mesh["fsdp"] == 1:
            return self.mesh
        return {**self.mesh, "data": self.mesh["data"] * self.mesh["fsdp"], "fsdp": 1}

    @property
    def context(self) -> int:
        """Ways each sequence is split (context parallelism; 1 without a context axis)."""
        return self.mesh.get("context", 1)

    @property
    def pipelined(self) -> bool:
        return self.mesh["pipeline"] > 1

    @property
    def micro_steps(self) -> int:
        """Micro-batches each device runs per optimizer step (accum, times the pipeline's)."""
        return self.accum * (self.microbatches if self.pipelined else 1)

    @property
    def micro_batch(self) -> int:
        """Sequences per device per micro-batch."""
        return self.batch // (self.data_parallel * self.micro_steps)

    @functools.cached_property
    def policy(self) -> Policy:
        """The --precision policy with this run's --grad-reduce (UsageError when invalid)."""
        return precision.get(self.precision, self.grad_reduce)

    @property
    def grad_dtype(self) -> str:
        return precision.short_name(self.policy.reduce_dtype)

    def bytes_of(self, role: str) -> int:
        """Bytes per element of "weights", "grads" or "compute" (activations)."""
        names = {"weights": "param", "grads": "reduce", "compute": "compute"}
        return self.policy.itemsize(names[role])


@dataclasses.dataclass(frozen=True)
class Network:
    """Links between devices: bytes/s per device inside a node and across nodes, seconds of
    latency per ring step, devices per node; and each device's link to its host's memory."""

    intra_bandwidth: float
    inter_bandwidth: float
    latency: float
    devices_per_node: int
    host_bandwidth: float = 50e9  # bytes/s per device, one direction, host <-> device (PCIe)


def check_setup(s: Setup) -> None:
    """UsageError when a value is out of range or a mesh axis does not divide what it splits."""
    choices: dict[str, Collection[str]] = {
        "precision": precision.POLICIES,
        "optimizer": optimizers.OPTIMIZERS,
        "remat": REMATS,
    }
    for name, valid in choices.items():
        if getattr(s, name) not in valid:
            flag = f"--{name} {getattr(s, name)!r}"
            hint = "; bf16 is the ZeRO paper's mixed precision" if name == "precision" else ""
            raise UsageError(f"{flag} is not one of {', '.join(valid)}{hint}")
    compute = precision.short_name(precision.POLICIES[s.precision].compute_dtype)
    if s.grad_reduce not in ("", "fp32", compute):
        raise UsageError(
            f"--grad-reduce {s.grad_reduce!r} does not go with --precision {s.precision}; use "
            f"fp32 or {compute} (or leave it out for {compute})"
        )
    if s.zero not in (0, 1, 2, 3):
        raise UsageError(f"--zero {s.zero} is not a ZeRO stage; use 0 (DDP), 1, 2 or 3")
    # what the engine refuses to offload (params below ZeRO-3, pipelines, DiLoCo)
    engine_offload.check(s.offload, s.zero, s.pipelined, vmapped=bool(s.sync_every))
    split = long_sequence.split_error(s.seq_len, s.context, s.mesh["tensor"], s.sequence_parallel)
    if split:
        raise UsageError(split)
    if s.cp_mode not in CP_MODES:
        raise UsageError(f"--cp-mode {s.cp_mode!r} is not one of {', '.join(CP_MODES)}")
    if s.context > 1 and s.cp_mode == "ulysses":
        heads = long_sequence.ulysses_error(
            s.shape.n_heads, s.shape.n_kv_heads, s.mesh["tensor"], s.context
        )
        if heads:
            raise UsageError(heads)
    if s.shape.n_experts and s.sequence_parallel:
        raise UsageError("an MoE model does not compose with --sequence-parallel yet")
    if s.shape.n_experts and s.context > 1 and s.shape.capacity_factor:
        raise UsageError(
            f"--capacity-factor {s.shape.capacity_factor} with cp={s.context}: an expert's "
            f"capacity counts a whole sequence's tokens, which cp splits; use --capacity-factor "
            f"0 (dropless) or cp=1"
        )
    pipeline = s.mesh["pipeline"]
    if s.pipelined:
        schedules.check_settings(s.schedule, pipeline, s.microbatches, s.virtual)
        if s.precision == "fp16":  # spmd.parallel.pipeline.check_composition refuses it too
            raise UsageError(
                "--precision fp16 needs loss scaling, which pipelines (pp > 1) do not apply "
                "inside their schedule; use --precision bf16 or fp32"
            )
    ways = s.data_parallel * s.micro_steps
    if s.batch < 1 or s.batch % ways:
        what = f"accum {s.accum}" + (f" x microbatches {s.microbatches}" if s.pipelined else "")
        raise UsageError(
            f"--batch {s.batch} is not divisible by data-parallel size {s.data_parallel} x "
            f"{what} = {ways}; use a multiple of {ways}"
        )
    tensor, fsdp = s.mesh["tensor"], s.sharded_fsdp
    shape = s.shape
    splits = [
        (tensor, "tp", "n_heads", shape.n_heads),
        (tensor, "tp", "n_kv_heads", shape.n_kv_heads),
    ]
    splits += [
        (tensor, "tp", "mlp_dim", shape.mlp_dim),
        (tensor, "tp", "vocab_size", shape.vocab_size),
    ]
    splits += [(pipeline * s.virtual, "pp", "n_layers", shape.n_layers)]
    splits += [(fsdp, "fsdp", "embed_dim", shape.embed_dim)]
    if shape.n_experts:
        ways, n = s.mesh.get("expert", 1) * s.sharded_fsdp, s.shape.n_experts
        if n % ways:
            good = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
            raise UsageError(
                f"--mesh ep={ways // s.sharded_fsdp},fsdp={s.sharded_fsdp} splits the experts "
                f"{ways} ways, which does not divide n_experts={n}; ep x fsdp must be one of {good}"
            )
        width = "expert_mlp_dim" if shape.expert_mlp_dim else "mlp_dim"
        splits += [(tensor, "tp", width, shape.expert_dim)]
    elif s.mesh.get("expert", 1) > 1:
        raise UsageError(
            f"--mesh ep={s.mesh['expert']} splits experts, but the model has none; use ep=1 or "
            f"an MoE model (--n-experts, e.g. --model moe-small)"
        )
    for ways, axis, field, size in splits:
        if size % ways:
            good = ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)
            raise UsageError(f"--mesh {axis}={ways} does not divide {field}={size}; use {good}")


def params_per_device(
    s: Setup, fsdp_shards: bool, layers: bool | None = None, experts: bool | None = None
) -> float:
    """Parameters one device holds (scalars); `fsdp_shards`: the role is sharded over fsdp
    (the routed experts are split over fsdp whatever the role). `layers` True counts only the
    stacked block params, False only the others, None all; `experts` likewise for an MoE's
    routed experts."""
    scale = s.n_params / shape_params(s.shape)
    fsdp = s.sharded_fsdp if fsdp_shards else 1
    return sum(
        count
        * scale
        / math.prod(s.sharding_mesh.get(a, 1) for a in axes)
        / (fsdp ** ("fsdp" not in axes and NO_FSDP not in axes))
        for count, axes in param_groups(s.shape)
        if (layers is None or layers == ("pipeline" in axes))
        and (experts is None or experts == (axes == EXPERT_AXES))
    )


def global_batch(micro_batch: int, data_parallel: int, micro_steps: int) -> int:
    """Sequences per optimizer step: per-device micro-batch x data-parallel size x the
    micro-batches per step."""
    return micro_batch * data_parallel * micro_steps
