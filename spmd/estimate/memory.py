"""Memory per device of a planned step, by role: params, gradients, master + optimizer state,
activations, overhead.

Model state follows the ZeRO paper (Rajbhandari et al. 2020, section 3 and Table 1). With
Psi parameters, N the fsdp size and mixed precision (--precision bf16 or fp16): 2 Psi bytes of
16-bit params, 2 Psi of gradients (4 Psi with --grad-reduce fp32) and K Psi = 12 Psi of fp32
master weights and Adam moments. Stage 0 holds (2 + 2 + K) Psi on every device, stage 1
(2 + 2) Psi + K Psi / N, stage 2 2 Psi + (2 + K) Psi / N, stage 3 (2 + 2 + K) Psi / N; for 7.5 B
params on 64 devices 120, 31.4, 16.6 and 1.88 GB. Under fp32 there is no separate master copy:
4 + 4 + 8 bytes. Tensor and pipeline axes divide what they split first (spmd.estimate.cost).
Under LoRA (Setup.lora_rank) the base is held in the params' dtype only (QLoRA's nf4:
0.5625 B/param, `frozen_base_bytes`) and the gradients, master and moments are the adapters'
(spmd.estimate.lora).
Units: bytes per device; GB = 1e9 bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from spmd.engine import optimizers
from spmd.estimate import cost, experts, long_sequence, lora, pipeline_figures

ROLES = ("params", "grads", "optimizer")  # and the stage from which ZeRO shards each:
SHARDED_FROM = {"params": 3, "grads": 2, "optimizer": 1}
# The roles each --offload keeps in host memory between steps (spmd.engine.offload.HOST_ROLES
# in these role names); the gradients always stay on the device.
HOST_ROLES = {"none": (), "optimizer": ("optimizer",), "params": ("optimizer", "params")}
# Of those, what the device does not hold at the step's peak either: the master weights and
# moments, assumed streamed through the update leaf by leaf after the backward pass. The
# engine moves the params in whole at the step's start (spmd.engine.offload), and the forward
# and backward compute with them, so --offload params frees device memory between steps only.
OFF_DEVICE_IN_STEP = ("optimizer",)
# fp32 buffers of one layer's attention probabilities live at once while its backward pass
# recomputes them (the scores, their softmax and its gradient): fitted to the tiny model's
# compiled temp memory at length 256 and 1024, whose length² part is 2.7 x one layer's scores
# (3.1 before the kernel was chunked).
SCORE_COPIES = 3


def bytes_per_param(s: cost.Setup) -> dict[str, float]:
    """Unsharded bytes per parameter: working params, gradients, master copy + moments (the
    mean over the params for an optimizer that keeps more state on some: Muon; Adafactor's
    m + n per factored m x n matrix, spmd.engine.adafactor.state_values, which assumes its
    factored means are sharded as the params are: they are replicated, m + n values)."""
    master = s.policy.itemsize("master") if s.policy.has_master else 0
    state = optimizers.state_bytes(s.optimizer, s.policy.itemsize("master"), matrix_share(s), s)
    return {
        "params": s.bytes_of("weights"),
        "grads": s.bytes_of("grads"),
        "optimizer": master + state,
    }


def matrix_share(s: cost.Setup) -> float:
    """The share of the trained params that are hidden matrices (spmd.engine.muon's split: the
    blocks' attention and MLP matrices, an MoE's experts; not the embedding, head, norms,
    biases or routers). Under LoRA 0: the planner counts the adapters at the other params'
    rate, AdamW's for Muon (an upper bound: some adapters are matrices Muon updates)."""
    if s.lora_rank:
        return 0.0
    counts = s.shape.param_counts()
    return (counts["matrices"] + counts.get("experts", 0)) / sum(counts.values())


def model_state_bytes(s: cost.Setup) -> dict[str, float]:
    """Bytes per device of params, grads and master + optimizer state, and their sum
    ("model_state"); for an MoE also "experts", the routed experts' part of model_state; for
    a full fine-tune's DPO "reference", its frozen copy's part of the params (no gradient or
    optimizer state; its forward keeps no activations for a backward pass, so activations
    are the policy's)."""
    per_param = bytes_per_param(s)
    out = {
        role: per_param[role] * cost.params_per_device(s, s.zero >= SHARDED_FROM[role])
        for role in ROLES
    }
    if s.lora_rank:  # a frozen base (params only) and the adapters, which alone are trained
        out = {
            role: per_param[role] * lora.adapters_per_device(s, s.zero >= SHARDED_FROM[role])
            for role in ROLES
        }
        out["params"] += frozen_base_bytes(s, per_param["params"])
    # a full fine-tune's DPO holds a frozen reference copy: params only, sharded as they are
    reference = per_param["params"] * cost.params_per_device(s, s.zero >= SHARDED_FROM["params"])
    reference = reference if s.reference_copy else 0.0
    out["params"] += reference
    out["model_state"] = sum(out.values())
    if reference:
        out["reference"] = reference  # of the params
    if s.shape.n_experts:  # of which the routed experts' (split over ep x fsdp)
        roles = ("params",) if s.lora_rank else ROLES  # LoRA: frozen experts, no state
        out["experts"] = sum(
            per_param[role] * cost.params_per_device(s, True, experts=True) for role in roles
        )
    return out


# QLoRA's quantized base (models/nf4.py): codes split as the weights they replace (nf4 0.5 B,
# int8 1 B per value), and one fp32 scale per 64 values, whole along `embed` (so not split over
# fsdp by ZeRO-3)
CODE_BYTES, SCALE_BYTES = lora.CODE_BYTES, 4 / 64


def frozen_base_bytes(s: cost.Setup, itemsize: float) -> float:
    """Bytes per device of a LoRA run's frozen base: its params at `itemsize` B (the working
    dtype), or under --lora-base-dtype nf4 (int8) every param but an MoE's routed experts
    (which stay in the working dtype) at 0.5 B (1 B) of codes + 1/16 B of scales. The norms
    are counted as quantized too: under 0.01% of a 1B model's params."""
    sharded = s.zero >= 3
    if s.lora_base_dtype not in CODE_BYTES:
        return itemsize * cost.params_per_device(s, sharded)
    experts = itemsize * cost.params_per_device(s, sharded, experts=True)
    codes = CODE_BYTES[s.lora_base_dtype] * cost.params_per_device(s, sharded, experts=False)
    return experts + codes + SCALE_BYTES * cost.params_per_device(s, False, experts=False)


def _layer_elements(s: cost.Setup, dense: bool = False) -> dict[str, float]:
    """Elements one layer (`dense`: one of an MoE's dense-MLP layers) keeps for the backward pass on
    one device, per remat policy, for a micro-batch of b sequences of length t, of which a
    device holds T = b*t/cp tokens (context parallelism; heads h, kv heads k, mlp width m
    divided by tensor; embed e and head_dim d whole; r = tp under sequence parallelism, else 1):
      none: T*(4e/r + (h + 2k)*d + h*d + 3m) (block input, its two norms' inputs and
        outputs; q, k, v; attention output; gate, up and silu(gate) * up, whose backward
        recomputes silu(gate), models.layers.swiglu; under cp the ring's visiting key / value
        blocks and partial outputs, spmd.estimate.long_sequence; not the attention
        probabilities, which the backward pass recomputes: activation_bytes counts them once);
      dots_saveable: T*(3e + (h + 2k)*d + 2m) (the weight matmuls' outputs);
      full: T*e/r (the block input only);
      offload: as full on the device (dots_saveable's set waits in host memory).
    LoRA adds rank x targets per token to none and dots_saveable (each adapter's x A).
    An MoE block replaces 3m (2m) by its buffers: per token its expert rows
    (spmd.estimate.experts.dispatch_slots: the sorted dispatch's routed rows and their block
    padding, or the one-hot dispatch's E x capacity / t slots) of the dispatched input and
    expert output (2e), gate, up, product (3m, m the expert width / tensor) and, one-hot, the
    dispatch and combine one-hots (2); 1e + 2m with dots_saveable. An
    estimate: --measure compares the compiled temp memory, not each term."""
    shape, tensor, cp = s.shape, s.mesh["tensor"], s.context
    b, t, e, d = s.micro_batch, s.seq_len, shape.embed_dim, shape.head_dim
    tokens, r = b * t / cp, long_sequence.residual_split(tensor, s.sequence_parallel)
    h, k, m = shape.n_heads / tensor, shape.n_kv_heads / tensor, shape.mlp_dim / tensor
    mlp_none, mlp_dots = 3 * m, 2 * m
    if shape.n_experts and not dense:  # per token: the expert buffers' slots, not k
        width = shape.expert_dim / tensor
        sorted_rows = experts.sorted_dispatch(s.sharding_mesh, s.sequence_parallel, s.precision)
        exchange = experts.exchange_of(s.sharding_mesh, b, s.sequence_parallel, s.precision)
        slots = experts.dispatch_slots(shape, t, sorted_rows, exchange)
        one_hots = 0 if sorted_rows else 2
        shared = shape.shared_dim / tensor  # its gate, up, product as a Llama's
        mlp_none = slots * (2 * e + 3 * width + one_hots) + 3 * shared
        mlp_dots = slots * (e + 2 * width) + 2 * shared
    if s.cp_mode == "ulysses":  # the all-to-alls' whole sequences of a share of the heads
        attention = long_sequence.ulysses_elements(shape, tokens, tensor, cp)
    else:  # the ring's visiting blocks and merges
        attention = long_sequence.ring_elements(shape, tokens, tensor, cp)
    # LoRA beside the matmul: each target's x A [tokens, r] too (whole over tensor); its x is
    # one the block keeps anyway, and the frozen W needs no other input for a gradient
    adapters = s.lora_rank * len(s.lora_targets)
    return {
        "none": tokens * (4 * e / r + (h + 2 * k) * d + h * d + mlp_none + adapters) + attention,
        "dots_saveable": tokens * (3 * e + (h + 2 * k) * d + mlp_dots + adapters),
        "full": tokens * e / r,
        # dots_saveable's set goes to host memory: the device keeps what full keeps
        "offload": tokens * e / r,
    }


def activation_bytes(s: cost.Setup) -> float:
    """Peak bytes of activations and working buffers on one device.

    The layers that run at once keep _layer_elements each: all n_layers / pp of a stage
    without a pipeline; with one, a single chunk of n_layers / (pp v) while its backward slot
    recomputes it, plus the schedule's stashed chunk inputs and output gradients (each one
    micro-batch's residual stream [b, t/cp/r, embed]: gpipe 2M, 1f1b at most 2p,
    spmd.estimate.pipeline_figures.stashed_inputs). With remat, one layer's no-remat set is
    live while it is replayed. Outside the blocks: the embedding output and final norm
    (2*b*t/cp/r*e) and the fp32 logits and their softmax (2*b*t/cp*vocab/tp*4 bytes; with
    the fused loss one chunk's instead of vocab/tp columns, `logit_columns`). The
    attention scores one layer's backward pass recomputes: SCORE_COPIES fp32 buffers of its
    probabilities (spmd.estimate.long_sequence.live_score_elements per sequence: past one
    key block the blockwise kernel's one block at a time). Under
    ZeRO-3 one layer's params gathered whole over fsdp (an MoE's experts stay split: the
    tokens travel to them). Activations are in the compute dtype.
    """
    shape, c = s.shape, s.bytes_of("compute")
    tokens, e = s.micro_batch * s.seq_len / s.context, shape.embed_dim
    residual = tokens * e / long_sequence.residual_split(s.mesh["tensor"], s.sequence_parallel)
    per_layer = _layer_elements(s)
    live_layers = shape.n_layers // (s.mesh["pipeline"] * s.virtual)
    kept = live_layers * per_layer[s.remat] + _dense_layers_difference(s, s.remat)
    replay = per_layer["none"] if s.remat != "none" else 0
    stash = pipeline_figures.stashed_inputs(s) * residual
    outside = 2 * residual * c + 2 * tokens * logit_columns(s) * 4
    heads = shape.n_heads / s.mesh["tensor"]
    scores = (
        SCORE_COPIES
        * s.micro_batch
        * long_sequence.live_score_elements(heads, s.seq_len, s.context, s.cp_mode)
    )
    gathered = 0.0
    if s.zero == 3 and s.sharded_fsdp > 1:
        stage_layers = shape.n_layers // s.mesh["pipeline"]
        blocks = cost.params_per_device(s, fsdp_shards=False, layers=True, experts=False)
        gathered = blocks / stage_layers * s.bytes_of("weights")
    return (kept + replay + stash) * c + outside + scores * 4 + gathered


def _dense_layers_difference(s: cost.Setup, remat: str) -> float:
    """What an MoE's dense-MLP layers keep beyond the sparse layers' figure that counts every
    layer (their MLP's buffers in place of the experts'); 0 without such layers (a pipeline
    never holds them: the layer groups run with pp = 1)."""
    if not s.shape.dense_layers:
        return 0.0
    dense, sparse = _layer_elements(s, dense=True)[remat], _layer_elements(s)[remat]
    return s.shape.dense_layers * (dense - sparse)


def logit_columns(s: cost.Setup) -> float:
    """Vocabulary columns of the fp32 logits one device holds at once: its share of the
    vocabulary, or of one chunk of it where the output layer and loss are fused over
    ceil(vocab / loss_chunk) chunks (models/fused_loss.py; a pipeline's last stage scores
    whole logits)."""
    vocab, chunk, tp = s.shape.vocab_size, s.shape.loss_chunk, s.mesh["tensor"]
    if s.mesh["pipeline"] > 1 or not chunk or vocab <= chunk:
        return vocab / tp
    return math.ceil(vocab / tp / math.ceil(vocab / chunk))


def offloaded_activation_bytes(s: cost.Setup) -> float:
    """Bytes one device keeps in host memory for the backward pass under --remat offload:
    dots_saveable's set (the weight matmuls' outputs) of the layers that run at once, for one
    micro-batch, in the compute dtype; 0 under any other remat."""
    if s.remat != "offload":
        return 0.0
    live_layers = s.shape.n_layers // (s.mesh["pipeline"] * s.virtual)
    kept = live_layers * _layer_elements(s)["dots_saveable"]
    return (kept + _dense_layers_difference(s, "dots_saveable")) * s.bytes_of("compute")


def memory(
    s: cost.Setup, overhead: float, hbm: float, host_memory: float = math.inf, per_node: int = 1
) -> dict[str, Any]:
    """Per-device bytes: params, grads, optimizer (master + moments), model_state (their
    sum, wherever it lives), activations, overhead, total (what device memory holds at the
    step's peak: the model state less the optimizer state --offload keeps on the host; the
    params stay in, OFF_DEVICE_IN_STEP), hbm, headroom (hbm - total); host_state (what
    --offload keeps on the host between steps), host_activations (--remat offload's), host
    (their sum), host_per_node (host x the devices of a node, of `per_node`), host_memory
    (bytes per node), host_fits; fits (total <= hbm and host_fits)."""
    out: dict[str, Any] = model_state_bytes(s)
    out["activations"] = activation_bytes(s)
    out["overhead"] = overhead
    out["host_state"] = sum(out[role] for role in HOST_ROLES[s.offload])
    out["host_activations"] = offloaded_activation_bytes(s)
    out["host"] = out["host_state"] + out["host_activations"]
    out["host_per_node"] = out["host"] * min(s.devices, per_node)
    off_device = sum(out[r] for r in HOST_ROLES[s.offload] if r in OFF_DEVICE_IN_STEP)
    out["total"] = out["model_state"] - off_device + out["activations"] + overhead
    out.update(hbm=hbm, headroom=hbm - out["total"], host_memory=host_memory)
    out["host_fits"] = out["host_per_node"] <= host_memory
    out["fits"] = out["total"] <= hbm and out["host_fits"]
    return out


def zero_stages(s: cost.Setup) -> list[cost.Setup]:
    """ZeRO 0, 1, 2 and 3 over all of s's devices (DDP on data, then fsdp), each running one
    micro-batch of s's size with s's remat and its state on the devices: the ZeRO paper's
    comparison for this run."""
    out = []
    for zero in range(4):
        mesh = {**dict.fromkeys(s.mesh, 1), "data" if zero == 0 else "fsdp": s.devices}
        batch = s.micro_batch * s.devices
        out.append(
            dataclasses.replace(
                s,
                mesh=mesh,
                zero=zero,
                batch=batch,
                accum=1,
                microbatches=1,
                virtual=1,
                offload="none",
            )
        )
    return out
