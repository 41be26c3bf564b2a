"""How long a planned step takes: compute at a sustained FLOP rate, the pipeline bubble and the
communication that compute does not hide.

FLOPs follow spmd.estimate.flops (Kaplan et al.; PaLM appendix B): per token, 2 FLOPs per
matmul parameter and 4 * layers * seq_len * heads * head_dim for attention in the forward,
three times that for forward + backward ("model FLOPs"). What the devices execute adds the
recomputation: remat "full" replays each block's forward, "dots_saveable" and "offload"
replay attention only (the weight matmuls' outputs are kept), and a pipeline stage re-runs its
chunk's forward inside every backward slot (spmd.parallel.pipeline stashes chunk inputs only);
an MoE's fixed-shape routing runs every capacity slot. Under --precision fp8 the blocks' weight
matmuls run at flops.FP8_MATMUL_SPEEDUP times the sustained rate (Hopper's fp8 tensor cores),
the rest (attention, the head, recomputed attention) at it. An optimizer whose update does
matmuls (Muon's Newton-Schulz iterations, its registry entry's update_flops) adds them once
per step, whatever the batch. Units: FLOPs, seconds, FLOP/s.

Under LoRA (Setup.lora_rank) the frozen base has no weight gradients: its weight matmuls
(blocks and head) run forward and the activations' backward only, two times their forward
instead of three, attention three times as ever, and each adapter (x A, then (x A) B, beside
its projection: models/adapter.py) adds 2 r (in + out) FLOPs per token forward, three times
that with its backward (A's and B's gradients, and x's through the adapter); under tensor
parallelism the adapter halves on the unsplit `embed` side run whole on every tensor device
(spmd.estimate.lora.tensor_replicated_flops), executed tp times.

DPO (Setup.objective) adds its reference model's forward of every row, blocks, attention and
head, with no backward (`reference_flops`): 8 N per token + attention where next-token
training is 6 N, as the run's own count (spmd.observe.observer).
"""

from __future__ import annotations

from spmd.engine import optimizers
from spmd.estimate import (
    comms,
    cost,
    experts,
    flops,
    long_sequence,
    lora,
    offload,
    pipeline_figures,
)
from spmd.estimate.shape import shape_params
from spmd.estimate.units import si


def forward_flops_per_token(s: cost.Setup) -> dict[str, float]:
    """Forward FLOPs of one token: "blocks" (the layers' matmuls), "attention" (scores and
    values, causal counted in full) and "head" (the output projection). An MoE's blocks count
    active params only: the router and the k routed experts (and the shared one)."""
    shape = s.shape
    scale = s.n_params / shape_params(shape)
    attention = shape.embed_dim * shape.head_dim * (2 * shape.n_heads + 2 * shape.n_kv_heads)
    active = shape.n_layers * attention + shape.active_mlp_params()
    return {
        "blocks": 2 * active * scale,
        "attention": 4 * shape.n_layers * s.seq_len * shape.n_heads * shape.head_dim,
        "head": 2 * shape.vocab_size * shape.embed_dim * scale,
        "adapters": 2 * lora.adapter_params(s) if s.lora_rank else 0.0,
    }


def weight_passes(s: cost.Setup) -> int:
    """How many times a step runs a weight matmul of the model: forward, the activations'
    backward and the weight gradient (3), or a LoRA base's forward and backward (2)."""
    return 2 if s.lora_rank else 3


def model_flops(s: cost.Setup) -> float:
    """Model FLOPs of one optimizer step over all devices (recomputation not counted), with
    DPO's reference forward (`reference_flops`)."""
    f = forward_flops_per_token(s)
    per_token = weight_passes(s) * (f["blocks"] + f["head"]) + 3 * (f["attention"] + f["adapters"])
    return s.batch * s.seq_len * per_token + reference_flops(s)


def reference_flops(s: cost.Setup) -> float:
    """FLOPs per step of DPO's reference model (LoRA's base with the adapters off, or the
    frozen copy): one forward of every row, blocks, attention and head, and no backward; 0
    for an objective without a reference."""
    if not s.reference_forward:
        return 0.0
    f = forward_flops_per_token(s)
    return s.batch * s.seq_len * (f["blocks"] + f["head"] + f["attention"])


def reference_words(s: cost.Setup, state: dict[str, float]) -> str:
    """The dry run's and the plan's line on DPO's reference: the pairs per step, the
    reference forward's FLOPs per step (no backward) and, for a full fine-tune's frozen copy,
    its bytes per device among the params (`state`: spmd.estimate.memory.model_state_bytes)."""
    held = state.get("reference", 0.0)
    where = f"a frozen copy, {held / 2**20:.2f} MiB of the params" if held else "LoRA's base"
    return (
        f"DPO: {s.batch // 2} pairs per step ({s.batch} rows); the reference forward "
        f"{si(reference_flops(s), 'FLOP')} per step of the model's {si(model_flops(s), 'FLOP')}"
        f" (no backward); the reference is {where}"
    )


def executed_flops(s: cost.Setup) -> float:
    """FLOPs the devices execute per optimizer step: model FLOPs less the attention scores the
    causal kernel skips, plus the recomputed forwards and attention scores, plus an MoE's
    routing padding
    (spmd.estimate.experts.padding_flops_per_token), forward and backward."""
    f = forward_flops_per_token(s)
    # the kernel computes only the causal share of the scores (its query chunks or key
    # blocks, the ring's blocks); model FLOPs count them whole, so the rest is taken off
    attention = f["attention"] * long_sequence.score_share(s.seq_len, s.context, s.cp_mode)
    skipped = (3 + s.reference_forward) * (f["attention"] - attention)  # DPO: its reference's
    layer = f["blocks"] + attention + f["adapters"]
    replays = layer * (s.pipelined + (s.remat == "full"))
    replays += attention * (s.remat in ("dots_saveable", "offload"))
    # without remat the attention kernel still recomputes its scores (q k^T) for the backward
    # pass instead of keeping them (models.attention.recomputed_attention)
    replays += attention / 2 * (s.remat == "none")
    sorted_rows = experts.sorted_dispatch(s.sharding_mesh, s.sequence_parallel, s.precision)
    exchange = experts.exchange_of(s.sharding_mesh, s.micro_batch, s.sequence_parallel, s.precision)
    forward, backward = experts.padding_flops_per_token(s.shape, s.seq_len, sorted_rows, exchange)
    replays += s.shape.sparse_layers * (
        forward * (1 + s.pipelined + (s.remat == "full")) + backward
    )
    if s.lora_rank:  # the adapters' halves each tensor device runs whole, three passes
        replays += 3 * lora.tensor_replicated_flops(s) * (s.mesh.get("tensor", 1) - 1)
    return model_flops(s) + s.batch * s.seq_len * (replays - skipped) + update_flops(s)


def update_flops(s: cost.Setup) -> float:
    """FLOPs of the optimizer's update per step beyond elementwise work (Muon's Newton-Schulz
    matmuls: spmd.engine.optimizers' entry), counted once over all devices; 0 under LoRA,
    whose adapters' few small matrices it leaves out."""
    make = optimizers.get(s.optimizer).update_flops
    return 0.0 if make is None or s.lora_rank else make(s.shape)


def fp8_flops(s: cost.Setup) -> float:
    """FLOPs per optimizer step of the blocks' weight matmuls, which --precision fp8 runs as
    fp8 dots (forward and both backward products, and full remat's or a pipeline's replay);
    the planner assumes every block matmul reaches the size rule (--fp8-min-dim)."""
    passes = weight_passes(s) + s.pipelined + (s.remat == "full")
    return s.batch * s.seq_len * forward_flops_per_token(s)["blocks"] * passes


def step_time(
    s: cost.Setup, net: cost.Network, flops_per_device: float, overlap: float = 0.0
) -> dict[str, float]:
    """Seconds of one optimizer step and its parts, with the work split evenly over devices:
    "compute" (executed FLOPs at `flops_per_device`), "bubble" (the pipeline's idle time,
    compute x f / (1 - f) for the bubble share f), "comm" (every collective, run alone),
    "hidden" (the share `overlap` of the data-parallel collectives, at most the compute, that
    runs behind compute), "exposed" (comm - hidden), "host" (the host transfers of --offload
    and --remat offload that compute does not hide, spmd.estimate.offload, at the network's
    host_bandwidth) and "step" (compute + bubble + exposed + host)."""
    compute = executed_flops(s) / s.devices / flops_per_device
    if s.precision == "fp8":  # the blocks' weight matmuls at the fp8 rate
        saved = fp8_flops(s) * (1 - 1 / flops.FP8_MATMUL_SPEEDUP)
        compute -= saved / s.devices / flops_per_device
    share = pipeline_figures.bubble_share(s)
    bubble = compute * share / (1 - share)
    times = [(c, comms.comm_time(s, c, net)) for c in comms.collectives(s)]
    comm = sum(t for _, t in times)
    hidden = min(overlap * sum(t for c, t in times if c.hideable), compute)
    exposed = comm - hidden
    host = offload.host_time(s, net.host_bandwidth, compute)["exposed"]
    return {
        "compute": compute,
        "bubble": bubble,
        "comm": comm,
        "hidden": hidden,
        "exposed": exposed,
        "host": host,
        "step": compute + bubble + exposed + host,
    }
