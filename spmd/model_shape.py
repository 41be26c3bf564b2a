"""The one description of a model that the estimators read: its sizes, as plain numbers.

A model family (models.family) builds a ModelShape from its config; spmd.estimate (the planner,
--dry-run's theory, the FLOP count) reads only these fields, so no estimator needs to know
which family it is looking at. A dense model is the case n_experts = 0.

This module sits at the bottom of spmd: it imports nothing from spmd, so models/ may build it.
Sizes are counts (tokens, features, heads, layers, experts); FLOPs are per trained token.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

# What the backward pass keeps of each block: none = every activation; full = nothing (the
# block's forward runs again); dots_saveable = the matmul outputs; offload = the matmul
# outputs, kept in host memory. The one list of the choices: each family's config field
# (models/layers.REMAT_POLICIES maps them to jax.checkpoint policies), the estimators, the
# benchmarks.
# The keys of a model's params whose leaves are stacked layers (a leading `layers` dim): the
# decoder blocks, and an MoE's dense-MLP layers where it has them (models/layer_groups.py).
STACKS = ("blocks", "dense_blocks")
# Kinds of ModelShape.param_counts that are no params of the model's count (n_params) but
# are carried, optimized by a rule of their own and checkpointed like them: an MoE's router
# correction bias (models/moe.py's RouterBias).
BUFFERS = ("router_bias",)
Remat = Literal["none", "dots_saveable", "full", "offload"]
REMATS: tuple[str, ...] = get_args(Remat)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Llama-like decoder's sizes, MoE included (n_experts 0: a dense gated MLP)."""

    vocab_size: int
    embed_dim: int
    mlp_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    remat: str = "none"  # none | full | dots_saveable | offload: what the backward pass keeps
    n_experts: int = 0  # routed experts per block (0: the dense MLP)
    experts_per_token: int = 0  # top-k
    expert_mlp_dim: int = 0  # hidden size of each expert (0: mlp_dim)
    shared_expert: bool = False  # one more expert that every token uses
    shared_expert_mlp_dim: int = 0  # its hidden size (0: expert_dim)
    capacity_factor: float = 0.0  # 0: dropless (capacity = the sequence length)
    # of the n_layers, those whose MLP is the dense one of mlp_dim, not experts (DeepSeek-V3's
    # first 3); the rest are sparse
    dense_layers: int = 0
    # the step moves the router's correction bias by this x sign(its gradient), outside the
    # optimizer (auxiliary-loss-free balancing, models/moe_routing.py); 0: no such rule
    router_bias_rate: float = 0.0
    router_bias: bool = False  # each sparse block's per-expert correction bias [E]
    # False when the training loss needs what a pipeline cannot pass between its stages (an
    # MoE's router losses): the planner then keeps pp = 1.
    pipelines: bool = True
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2): no matmul FLOPs
    qk_norm: bool = False  # a per-head RMS norm scale on q and on k (Qwen3)
    # RMSNorm scales [embed] per block: 2 in a Llama (before attention and before the MLP), 4
    # in Gemma's sandwich (after each as well)
    norms_per_block: int = 2
    # RMS norm scales on q and k over all heads' features, [heads, head_dim] and [kv_heads,
    # head_dim], split with the heads (OLMo 2)
    whole_qk_norm: bool = False
    # the output layer and loss run over chunks of this many vocabulary columns, the logits
    # never whole (models/fused_loss.py); 0: unfused
    loss_chunk: int = 0
    attn_sinks: bool = False  # one learned softmax logit per query head [heads] (GPT-OSS)
    o_bias: bool = False  # a bias [embed] on the attention's output projection (GPT-OSS)
    # biases on the router's logits [E], each expert's gate and up [E, 2 x expert_dim] and
    # down [E, embed] (GPT-OSS)
    expert_bias: bool = False

    @property
    def expert_dim(self) -> int:
        """Hidden size of one expert (expert_mlp_dim, or mlp_dim when that is 0)."""
        return self.expert_mlp_dim or self.mlp_dim

    @property
    def shared_dim(self) -> int:
        """Hidden size of the shared expert (0 without one; expert_dim unless set)."""
        return (self.shared_expert_mlp_dim or self.expert_dim) if self.shared_expert else 0

    @property
    def sparse_layers(self) -> int:
        """Layers whose MLP is the routed experts (0 in a dense model)."""
        return self.n_layers - self.dense_layers if self.n_experts else 0

    def param_counts(self) -> dict[str, int]:
        """Parameters (scalars) of each kind the model holds, the one count of them (a family's
        n_params, the planner's groups in spmd.estimate.shape): "matrices" (every block's
        attention and dense MLP, or its shared expert), "norms" (every block's RMSNorm scales),
        "tables" (embedding, and the head unless tied), "final_norm"; and only where the model
        has them "qkv_bias", "qk_norm" (per head), "whole_qk_norm" (over all heads), "sinks",
        "o_bias", "router" and "experts" (the routed ones), "router_bias" (their correction
        biases, a buffer: BUFFERS), "router_logit_bias" (the router's trained bias),
        "expert_bias" (gate and up) and "expert_out_bias" (down)."""
        e, d, layers, sparse = self.embed_dim, self.head_dim, self.n_layers, self.sparse_layers
        # a sparse layer's shared expert (if any) is a dense MLP of shared_dim
        mlps = (layers - sparse) * 3 * e * self.mlp_dim + sparse * 3 * e * self.shared_dim
        counts = {
            "matrices": layers * e * d * (2 * self.n_heads + 2 * self.n_kv_heads) + mlps,
            "norms": layers * self.norms_per_block * e,
            "tables": self.vocab_size * e * (1 if self.tie_embeddings else 2),
            "final_norm": e,
        }
        if self.qkv_bias:  # [heads, head_dim] and twice [kv_heads, head_dim] per block
            counts["qkv_bias"] = layers * d * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:  # two [head_dim] scales per block
            counts["qk_norm"] = layers * 2 * d
        if self.whole_qk_norm:  # [heads, head_dim] and [kv_heads, head_dim] per block
            counts["whole_qk_norm"] = layers * d * (self.n_heads + self.n_kv_heads)
        if self.attn_sinks:
            counts["sinks"] = layers * self.n_heads
        if self.o_bias:
            counts["o_bias"] = layers * e
        if self.n_experts:  # each sparse block's router [embed, experts], then its experts
            counts["router"] = sparse * e * self.n_experts
            counts["experts"] = sparse * self.n_experts * 3 * e * self.expert_dim
        if self.n_experts and self.router_bias:  # [E] per sparse block, no embed dim
            counts["router_bias"] = sparse * self.n_experts
        if self.n_experts and self.expert_bias:
            counts["router_logit_bias"] = sparse * self.n_experts
            counts["expert_bias"] = sparse * self.n_experts * 2 * self.expert_dim
            counts["expert_out_bias"] = sparse * self.n_experts * e
        return counts

    def n_params(self) -> int:
        """Parameters of the model (scalars; every expert included; not the buffers the step
        carries beside them, BUFFERS, which the gradient does not train)."""
        return sum(n for kind, n in self.param_counts().items() if kind not in BUFFERS)

    def n_active_params(self) -> int:
        """Parameters one token uses: all but the E - k routed experts it skips in every
        sparse layer (all of them in a dense model)."""
        idle = self.sparse_layers * (self.n_experts - self.experts_per_token)
        per_expert = 3 * self.embed_dim * self.expert_dim
        if self.expert_bias:  # its biases too
            per_expert += 2 * self.expert_dim + self.embed_dim
        return self.n_params() - idle * per_expert

    def active_mlp_params(self) -> int:
        """MLP params one token uses in all layers together: in each sparse layer the router,
        k experts and the shared one; in each dense layer (every layer without experts) the
        dense MLP."""
        e, routed = self.embed_dim, self.experts_per_token * self.expert_dim
        sparse = self.sparse_layers * (e * self.n_experts + 3 * e * (routed + self.shared_dim))
        return sparse + (self.n_layers - self.sparse_layers) * 3 * e * self.mlp_dim

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs (forward + backward) per trained token, the usual convention for a
        decoder-only transformer (Kaplan et al.; PaLM, appendix B): 6 per matmul parameter a
        token uses (an MoE's router, k experts and shared expert, not all E) plus attention's two
        [length x length] matmuls, 12 x layers x length x heads x head_dim, counted in full even
        when causal. The embedding lookup is not a matmul; the output head always is."""
        e, d = self.embed_dim, self.head_dim
        attention_params = e * d * (2 * self.n_heads + 2 * self.n_kv_heads)
        matmul_params = self.n_layers * attention_params + self.active_mlp_params()
        matmul_params += e * self.vocab_size
        attention_scores = 12 * self.n_layers * seq_len * self.n_heads * d
        return 6.0 * matmul_params + attention_scores


# XLA's causal attention splits the queries along length into 4 or 2 chunks of at least
# QUERY_CHUNK_MIN positions (models.attention.chunked_causal_attention): chunk i of n sees only
# the first (i + 1) / n of the keys, so the blocks above the diagonal are never computed. More
# chunks measured no faster on a CPU and compile longer (docs/speed.md).
QUERY_CHUNKS, QUERY_CHUNK_MIN = (4, 2), 32


def query_chunks(seq_len: int) -> int:
    """How many equal chunks XLA's causal attention splits `seq_len` queries into: the most of
    QUERY_CHUNKS that divides it into chunks of at least QUERY_CHUNK_MIN positions, else 1."""
    for n in QUERY_CHUNKS:
        if seq_len % n == 0 and seq_len // n >= QUERY_CHUNK_MIN:
            return n
    return 1


# The blockwise (flash) attention kernel's query and key blocks, in positions
# (models/blockwise_attention.py): one block's fp32 scores are batch x heads x 1 MiB, and 512
# keeps XLA's dots large enough to run near their peak. Past one key block it is the kernel.
ATTENTION_BLOCK = 512


def causal_score_share(seq_len: int) -> float:
    """The share of the length x length scores causal attention computes (and its backward
    pass recomputes): within one key block XLA's chunked kernel, (n + 1) / 2n for n query
    chunks (1 unchunked); past it the blockwise kernel, whose query block i runs key blocks 0
    to i: nb (nb + 1) / 2 blocks of ATTENTION_BLOCK² for nb = ceil(seq_len / ATTENTION_BLOCK)
    blocks (the last padded), about 1/2 at long lengths. Windows and documents are counted as
    plain causal attention (the kernel skips more)."""
    if seq_len > ATTENTION_BLOCK:
        blocks = -(-seq_len // ATTENTION_BLOCK)
        return blocks * (blocks + 1) / 2 * ATTENTION_BLOCK**2 / seq_len**2
    n = query_chunks(seq_len)
    return (n + 1) / (2 * n)


# The sort-based MoE dispatch's CPU grouped matmul (models/moe_dispatch.py) pads each expert's
# group of a sequence's routed rows to a multiple of MOE_BLOCK_ROWS and runs a scan over the
# blocks, each with its expert's weights: smaller blocks pad less but loop more.
MOE_BLOCK_ROWS = 16


def moe_grouped_rows(pairs: int, n_experts: int) -> int:
    """Rows the CPU grouped matmul runs for one sequence's `pairs` routed (token, choice)
    pairs over `n_experts` groups: fixed at trace time by the padding bound (each non-empty
    group pads by at most MOE_BLOCK_ROWS - 1 rows; the total is a whole number of blocks)."""
    padded = pairs + min(n_experts, pairs) * (MOE_BLOCK_ROWS - 1)
    return padded // MOE_BLOCK_ROWS * MOE_BLOCK_ROWS


def moe_peer_block_rows(
    sequences: int, length: int, k: int, local_experts: int, capacity: int
) -> int:
    """Rows of the block one device sends each peer in the sorted MoE rows' padded all-to-all
    (models/moe_all_to_all.py): the most (token, choice) pairs of its `sequences` sequences of
    `length` tokens that can go to the `local_experts` experts a peer holds: a token picks
    distinct experts, so at most min(k, local_experts) of its pairs, and each expert takes at
    most `capacity` pairs of a sequence."""
    return sequences * min(length * min(k, local_experts), local_experts * capacity)
