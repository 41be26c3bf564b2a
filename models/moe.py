"""A mixture-of-experts Llama (Mixtral-style) in Flax NNX, speaking logical axis names only.

Each block is models/llama.py's block with the MLP replaced by `n_experts` SwiGLU experts and
a learned router: softmax over the experts, then the top `experts_per_token` (their weights
renormalised to sum to one, Mixtral's convention, or with `norm_topk_prob` false kept as the
softmax gave them, as Qwen3-MoE's released configs do), optionally plus one shared SwiGLU
expert that every token uses. Attention, norms, embedding and head are llama.py's. The
router's other options (sigmoid scores, a correction bias, group-limited top-k, a routed
scaling factor: DeepSeek-V3's) are models/moe_routing.py's.

Routing is grouped per sequence: within each sequence an expert takes at most `capacity`
(token, choice) pairs, in token order; the rest are dropped (their share of the output is
zero, the residual carries the token on). `capacity_factor` 0 is dropless (capacity = the
sequence length, so nothing can drop); otherwise capacity = ceil(factor x length x k / E). As
the groups are sequences, which tokens drop depends on the router only, never on the mesh.

Dispatch is sort-based (models/moe_dispatch.py: only the routed rows run, as a grouped
matmul); where the experts are split over devices the sorted rows travel to them and back by
all-to-all (models/moe_all_to_all.py). GShard's one-hot einsums into a buffer [expert, batch,
capacity, embed], moved by `to_experts` / `from_experts`, are the reference
(`Experts.reference`) and what runs under sequence parallelism, fp8 experts, or split experts
under a pipeline or context parallelism (`Experts.__call__`).

Per layer the block also returns router statistics: the load-balancing loss (Switch /
Mixtral's E x sum_e f_e P_e over the batch, or DeepSeek-V3's per sequence: `aux_loss_scope`,
models/moe_routing.balance_loss), the router z-loss (mean squared logsumexp of the router
logits), dropped choices and the choices per expert. The training loss adds aux_loss_coef x
aux + z_loss_coef x z, each averaged over layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from models import layer_groups, llama, moe_all_to_all, moe_dispatch, moe_routing
from models.attention import Attention
from models.layers import REMAT_POLICIES, RMSNorm, creator, expert_dense, swiglu
from models.layers import param as _param
from models.llama import LlamaConfig
from models.moe_routing import top_k as top_k  # (re-exported: the router's stable top-k)
from spmd.errors import UsageError
from spmd.model_shape import ModelShape
from spmd.parallel.hooks import (
    constrain,
    exchange_blocked,
    experts_split,
    fp8_site,
    from_experts,
    gather,
    note,
    scan_layers,
    sequence_parallel,
    to_experts,
    token_mean,
    token_positions,
    tp_enter,
    tp_reduce,
)


@dataclasses.dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """LlamaConfig plus the experts (n_experts 0: the dense Llama). Sizes are counts."""

    family: str = "moe"
    n_experts: int = 0  # experts per block (0: the dense Llama MLP)
    experts_per_token: int = 2  # top-k: experts each token is routed to
    expert_mlp_dim: int = 0  # hidden size of each expert (0: mlp_dim)
    shared_expert: bool = False  # plus one SwiGLU expert that every token uses
    # its hidden size (0: expert_mlp_dim); DeepSeek's n_shared_experts shared experts of
    # width w are one of width n_shared_experts x w (their outputs add, like its hidden units)
    shared_expert_mlp_dim: int = 0
    capacity_factor: float = 0.0  # 0: dropless; else capacity = ceil(f x length x k / E)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss in the training loss
    aux_loss_scope: Literal["batch", "sequence"] = "batch"  # the batch's load or each sequence's
    z_loss_coef: float = 0.001  # weight of the router z-loss in the training loss
    # true: the chosen experts' router probabilities are rescaled to sum to one (Mixtral);
    # false: each is used as the softmax over all experts gave it (Qwen3-MoE's released models)
    norm_topk_prob: bool = True
    # softmax: the router's scores are a softmax over the experts (Mixtral, Qwen3-MoE);
    # sigmoid: one sigmoid per expert (DeepSeek-V3, GLM-4.5); models/moe_routing.py
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    routed_scaling_factor: float = 1.0  # times the routed experts' weights (DeepSeek-V3: 2.5)
    # group-limited top-k (DeepSeek-V3: 8 and 4): the experts in n_group equal groups, a token's
    # experts only from its topk_group best groups (each scored by its two best scores)
    n_group: int = 1  # 1: no groups
    topk_group: int = 1  # groups each token may choose from (at most n_group)
    # true: a per-expert bias added to the scores to choose the experts, not to weight them
    # (DeepSeek-V3's e_score_correction_bias); not trained by the gradient
    router_bias: bool = False
    # each step, bias += rate x sign(mean load - expert's load) (DeepSeek-V3's auxiliary-loss-
    # free balancing, 0.001 there); 0: the bias stays as loaded. Needs router_bias
    router_bias_rate: float = 0.0
    # the layers whose MLP is the dense Llama MLP (mlp_dim wide), not experts: indices and
    # inclusive ranges, "0-2" for DeepSeek-V3's first_k_dense_replace 3, Qwen3-MoE's
    # mlp_only_layers as they are listed; "": every layer sparse. Each kind of layer is its own
    # stack (models/layer_groups.py)
    dense_layers: str = ""

    def dense_layer_set(self) -> tuple[int, ...]:
        """The sorted indices of the dense-MLP layers (UsageError for a value that names none
        of the model's layers, or all of them)."""
        return layer_groups.dense_layer_set(self.dense_layers, self.n_layers)

    @property
    def expert_dim(self) -> int:
        return self.expert_mlp_dim or self.mlp_dim

    def shape(self) -> ModelShape:
        """The sizes the estimators read (spmd.model_shape), the experts' included. A pipeline
        cannot carry the router losses between its stages, nor split two stacks (check_layout)."""
        router_losses = bool(self.n_experts and (self.aux_loss_coef or self.z_loss_coef))
        return dataclasses.replace(
            super().shape(),
            n_experts=self.n_experts,
            experts_per_token=self.experts_per_token,
            expert_mlp_dim=self.expert_mlp_dim,
            shared_expert=self.shared_expert,
            shared_expert_mlp_dim=self.shared_expert_mlp_dim,
            capacity_factor=self.capacity_factor,
            router_bias_rate=self.router_bias_rate if self.router_bias else 0.0,
            router_bias=self.router_bias,
            dense_layers=len(self.dense_layer_set()) if self.n_experts else 0,
            # a pipeline slices one stack: a model of two (dense_layers) runs with pp = 1
            pipelines=not router_losses and not self.dense_layers,
        )

    def capacity(self, seq_len: int) -> int:
        """(token, choice) pairs one expert takes per sequence."""
        if self.capacity_factor <= 0:
            return seq_len
        wanted = self.capacity_factor * seq_len * self.experts_per_token / self.n_experts
        return min(seq_len, math.ceil(wanted))


def check(cfg: MoEConfig) -> None:
    """UsageError for settings that cannot run: the dense Llama's (llama.check), then the
    experts' (counts, and router weights that are finite and not negative)."""
    llama.check(cfg)
    if cfg.n_experts < 0:
        raise UsageError(f"--n-experts {cfg.n_experts} must be >= 0 (0: the dense Llama MLP)")
    if cfg.n_experts and not 1 <= cfg.experts_per_token <= cfg.n_experts:
        raise UsageError(
            f"--experts-per-token {cfg.experts_per_token} with --n-experts {cfg.n_experts}: "
            f"need 1 <= experts-per-token <= n-experts"
        )
    if cfg.expert_mlp_dim < 0:
        raise UsageError(
            f"--expert-mlp-dim {cfg.expert_mlp_dim} must be a positive width, or 0 (--mlp-dim)"
        )
    if cfg.shared_expert_mlp_dim < 0 or (cfg.shared_expert_mlp_dim and not cfg.shared_expert):
        raise UsageError(
            f"--shared-expert-mlp-dim {cfg.shared_expert_mlp_dim} must be a positive width "
            f"with --shared-expert true, or 0 (--expert-mlp-dim)"
        )
    # `not 0 <= x < inf` refuses NaN too; a negative loss weight would reward what it penalises
    if not 0 <= cfg.capacity_factor < math.inf:
        raise UsageError(
            f"--capacity-factor {cfg.capacity_factor} must be >= 0 (0: dropless, no token dropped)"
        )
    for flag, coef in (("--aux-loss-coef", cfg.aux_loss_coef), ("--z-loss-coef", cfg.z_loss_coef)):
        if not 0 <= coef < math.inf:
            raise UsageError(f"{flag} {coef} must be a finite weight >= 0 (0: off)")
    if cfg.n_experts:
        moe_routing.check_routing(cfg)  # scores, groups, scaling (models/moe_routing.py)
        cfg.dense_layer_set()  # the dense-MLP layers name layers of the model
    elif cfg.dense_layers:
        raise UsageError(
            f"--dense-layers {cfg.dense_layers!r} needs --n-experts > 0 (without experts every "
            f"layer is dense)"
        )


def check_layout(cfg: LlamaConfig, mesh: Any, executor: str) -> None:
    """UsageError for what an MoE model does not compose with: a pipeline (pp > 1) passes
    only activations between stages, so it cannot carry the router losses: it needs
    --aux-loss-coef 0 --z-loss-coef 0 (the router still trains through the output weights).
    The attention's refusals are the dense Llama's (llama.check_layout)."""
    llama.check_layout(cfg, mesh, executor)
    if not isinstance(cfg, MoEConfig) or not cfg.n_experts:  # dense: nothing more to check
        return
    check(cfg)
    if mesh.shape["context"] > 1 and cfg.capacity_factor:
        raise UsageError(
            f"--capacity-factor {cfg.capacity_factor} with cp={mesh.shape['context']}: an "
            f"expert's capacity counts a whole sequence's tokens, which cp splits; use "
            f"--capacity-factor 0 (dropless) or cp=1"
        )
    if mesh.shape["pipeline"] > 1 and cfg.dense_layers:
        raise UsageError(
            f"--mesh with pp={mesh.shape['pipeline']} cannot split a model whose layers are two "
            f"stacks (--dense-layers {cfg.dense_layers}: dense-MLP and sparse layers); use pp=1"
        )
    if mesh.shape["pipeline"] > 1 and (cfg.aux_loss_coef or cfg.z_loss_coef):
        raise UsageError(
            f"--mesh with pp={mesh.shape['pipeline']} cannot carry the MoE router losses "
            f"between pipeline stages (--aux-loss-coef {cfg.aux_loss_coef}, --z-loss-coef "
            f"{cfg.z_loss_coef}); pass --aux-loss-coef 0 --z-loss-coef 0, or use pp=1"
        )


class RouterBias(nnx.Variable):
    """The per-expert correction bias [E] (`router_bias`): it only chooses experts, so the
    loss has no gradient for it, and it is carried, checkpointed and loaded with the params."""


class Experts(nnx.Module):
    """Router + E SwiGLU experts (+ an optional shared expert)."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        e, m, n = cfg.embed_dim, cfg.expert_dim, cfg.n_experts
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.router = _param(rngs, 0.02, (e, n), ("embed", None))
        self.w_gate = _param(rngs, 0.02, (n, e, m), ("expert", "embed", "mlp"))
        self.w_up = _param(rngs, 0.02, (n, e, m), ("expert", "embed", "mlp"))
        self.w_down = _param(rngs, out_std, (n, m, e), ("expert", "mlp", "embed"))
        if cfg.shared_expert:
            shared = dataclasses.replace(cfg, mlp_dim=cfg.shared_expert_mlp_dim or m)
            self.shared = llama.MLP(shared, rngs)
        if cfg.router_bias:  # zeros: it starts choosing as if there were none
            self.router_bias = RouterBias(jnp.zeros((n,), jnp.float32), out_sharding=(None,))
        self.cfg = cfg

    def expert_weights(self) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple]:
        """((w_gate [E, embed, mlp], w_up, w_down [E, mlp, embed]) gathered, and the experts'
        biases of gate, up and down ([E, mlp] twice, [E, embed]), none here: what the
        dispatch kernels multiply and add (models/moe_dispatch.py)."""
        return (gather(self.w_gate), gather(self.w_up), gather(self.w_down)), ()

    def activation(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The experts' hidden units of their gate and up projections: SwiGLU."""
        return swiglu(gate, up)

    def router_logits(self, x: jax.Array) -> jax.Array:
        """fp32 [b, t, E]: the router's logit of each expert for each token of x [b, t, embed]."""
        return jnp.einsum("bte,en->btn", x.astype(jnp.float32), gather(self.router))

    def choose(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(logits [b, t, E] fp32, probabilities [b, t, E], the top k's weights [b, t, k] and
        experts [b, t, k], largest first): models/moe_routing.py's choice."""
        logits = constrain(self.router_logits(x), ("batch", "length", None))
        bias = self.router_bias[...] if self.cfg.router_bias else None
        probs, weights, top_experts = moe_routing.choose(self.cfg, logits, bias)
        if bias is not None and self.cfg.router_bias_rate:  # the load, as the bias's gradient
            per_expert = jax.nn.one_hot(top_experts, self.cfg.n_experts).sum(2).mean((0, 1))
            weights = moe_routing.load_feedback(weights, bias, token_mean(per_expert))
        return logits, probs, weights, top_experts

    def stats(
        self, logits: jax.Array, probs: jax.Array, top_experts: jax.Array, kept: jax.Array
    ) -> dict:
        """The router statistics of one layer (module docstring); `kept` [b, t x k] or any
        shape with one entry per (token, choice) pair: 1 where the pair was not dropped."""
        n = self.cfg.n_experts
        per_token = jax.nn.one_hot(top_experts, n, dtype=jnp.float32).sum(axis=2)  # [b, t, E]
        share = token_mean(per_token.mean(axis=(0, 1)))  # f_e, sums to k
        return {
            "aux_loss": moe_routing.balance_loss(self.cfg, per_token, probs, share),
            "z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
            "dropped": jax.lax.stop_gradient(token_mean(1.0 - kept.astype(jnp.float32).mean())),
            "load": jax.lax.stop_gradient(share),
        }

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
        """The one-hot reference routing: (dispatch [b, t, E, C] 0/1, combine weights [b, t,
        E, C], router logits, stats)."""
        cfg = self.cfg
        n, k, cap = cfg.n_experts, cfg.experts_per_token, cfg.capacity(x.shape[1])
        logits, probs, weights, top_experts = self.choose(x)
        choice = jax.nn.one_hot(top_experts, n, dtype=jnp.float32)  # [b, t, k, E]
        b, t = x.shape[:2]
        flat = choice.reshape(b, t * k, n)  # token-major: token 0's choices, then token 1's
        # place of each (token, choice) in its expert's queue
        position = (jnp.cumsum(flat, axis=1) * flat).sum(-1).astype(jnp.int32) - 1
        slot = jax.nn.one_hot(position, cap, dtype=jnp.float32)  # all zeros past capacity
        kept = (flat[..., None] * slot[..., None, :]).reshape(b, t, k, n, cap)
        dispatch = constrain(kept.sum(axis=2), ("batch", "length", None, None))
        combine = jnp.einsum("btk,btknc->btnc", weights, kept)
        combine = constrain(combine, ("batch", "length", None, None))
        stats = self.stats(logits, probs, top_experts, kept.sum((3, 4)))
        return dispatch, combine, logits, stats

    def reference(self, x: jax.Array) -> tuple[jax.Array, dict]:
        """GShard's one-hot einsum dispatch into a buffer [expert, batch, capacity, embed]: what
        runs where the experts are split over devices (its all-to-alls), and the tests' oracle
        for the sorted dispatch."""
        dtype = x.dtype
        dispatch, combine, _, stats = self.route(x)
        buffer = jnp.einsum("btnc,bte->nbce", dispatch.astype(dtype), x)
        buffer = to_experts(buffer)  # [E_local, tokens' rows, capacity, embed]
        buffer = tp_enter(buffer, "mlp")  # column-parallel gate and up inside each expert
        (w_gate, w_up, w_down), biases = self.expert_weights()
        gate, up = expert_dense(buffer, w_gate), expert_dense(buffer, w_up)
        if biases:  # each expert's, on every slot (empty slots' combine weights are 0)
            gate = gate + biases[0][:, None, None].astype(dtype)
            up = up + biases[1][:, None, None].astype(dtype)
        hidden = constrain(self.activation(gate, up), ("expert", "batch", None, "mlp"))
        out = tp_reduce(expert_dense(hidden, w_down), "mlp")  # row-parallel sum
        if biases:  # after the sum: once
            out = out + biases[2][:, None, None].astype(dtype)
        out = from_experts(out)  # back to the tokens
        y = jnp.einsum("btnc,nbce->bte", combine.astype(dtype), out)
        if self.cfg.shared_expert:
            y = y + self.shared(x)
        return y, stats

    def sort_dispatch(self, x: jax.Array, exchanged: bool = False) -> tuple[jax.Array, dict]:
        """The sort-based dispatch (models/moe_dispatch.py): only the routed rows run.
        `exchanged`: the experts are split over devices and the rows travel to them by
        all-to-all (models/moe_all_to_all.py)."""
        cfg = self.cfg
        b, t, _ = x.shape
        logits, probs, weights, top_experts = self.choose(x)
        experts = top_experts.reshape(b, -1)  # [b, t x k], token-major
        kept = moe_dispatch.kept_pairs(experts, cfg.n_experts, cfg.capacity(t), t)
        kernel = functools.partial(moe_dispatch.grouped_swiglu, act=self.activation)
        if exchanged:
            kernel = functools.partial(
                moe_all_to_all.exchanged_swiglu, capacity=cfg.capacity(t), act=self.activation
            )
        matrices, biases = self.expert_weights()
        out = kernel(x, experts, kept, *matrices, *biases)
        mix = (weights.reshape(b, -1) * kept).astype(x.dtype)  # a dropped pair adds nothing
        y = jnp.einsum("bp,bpe->bpe", mix, out).reshape(b, t, -1, x.shape[-1]).sum(axis=2)
        y = constrain(y, ("batch", "length", "embed"))
        if cfg.shared_expert:
            y = y + self.shared(x)
        return y, self.stats(logits, probs, top_experts, kept)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        """The sorted dispatch, its rows sent to their experts by all-to-all where the layout
        splits the experts over devices; the one-hot reference where the layout splits the
        length for the experts' tensor parallelism (sequence parallelism), runs the experts in
        fp8, or splits the experts where the all-to-all cannot run (a pipeline, context
        parallelism: spmd.parallel.expert_exchange.exchange_blocked)."""
        e, m = self.cfg.embed_dim, self.cfg.expert_dim
        split = experts_split()
        if sequence_parallel("mlp"):
            note("moe_dispatch", "one-hot einsum (sequence parallelism)")
        elif fp8_site(e, m) is not None:
            note("moe_dispatch", "one-hot einsum (fp8 experts)")
        elif split and (blocked := exchange_blocked()) is not None:
            note("moe_dispatch", f"one-hot einsum (experts split over devices, {blocked})")
        else:
            return self.sort_dispatch(x, exchanged=split)
        return self.reference(x)


class Block(nnx.Module):
    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.experts = Experts(cfg, rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        x = x + self.attn(self.attn_norm(x), positions, segments)
        y, stats = self.experts(self.mlp_norm(x))
        return constrain(x + y, ("batch", "length", "embed")), stats

    def decode(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, layer: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block over one layer's key / value cache (llama.Block.decode). Routing groups
        tokens per row of the call, so a dropless model (capacity_factor 0) routes each token
        as in the full forward pass; with a capacity factor, tokens may drop differently than
        in training's longer rows."""
        attended, keys, values = self.attn.cached(self.attn_norm(x), positions, keys, values)
        x = x + attended
        y, _ = self.experts(self.mlp_norm(x))
        return constrain(x + y, ("batch", "length", "embed")), keys, values


class MoELlama(llama.Llama):
    """llama.Llama with MoE blocks: tokens [batch, length] -> logits [batch, length, vocab]."""

    block_type = Block  # the rest (embedding, stacked layers, head) is llama.Llama's
    cfg: MoEConfig  # create makes one only for an MoEConfig with experts

    def make_stacks(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        """`self.blocks`: the sparse layers, stacked; with dense-MLP layers (`dense_layers`)
        also `self.dense_blocks`, llama.Block's stacked (models/layer_groups.py)."""
        assert isinstance(cfg, MoEConfig)
        dense = cfg.dense_layer_set()
        sparse = cfg.n_layers - len(dense)
        self.blocks = llama.stacked_blocks(type(self).block_type, cfg, sparse, rngs)
        if dense:
            self.dense_blocks = llama.stacked_blocks(llama.Block, cfg, len(dense), rngs)

    def layer_runs(self) -> list[tuple[nnx.Module, layer_groups.Run]]:
        """The model's layers in order as runs of one kind, each with the stack it reads."""
        dense = self.cfg.dense_layer_set()
        return [
            (self.dense_blocks if run.dense else self.blocks, run)
            for run in layer_groups.runs(dense, self.cfg.n_layers)
        ]

    def forward(
        self, tokens: jax.Array, segments: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        """(logits, router statistics of every layer, stacked on a leading layers dim); with
        `segments` (document ids) attention stays within documents, as in llama.Llama."""
        x, stats = self.apply_blocks_with_stats(self.embed_tokens(tokens), segments)
        return self.head_logits(x), stats

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        return self.forward(tokens, segments)[0]

    def apply_blocks(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """The blocks without their router statistics (what a pipeline stage runs)."""
        return self.apply_blocks_with_stats(x, segments)[0]

    def apply_blocks_with_stats(
        self, x: jax.Array, segments: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        if segments is None:
            positions = token_positions(x)  # global positions, also under SP and CP
        else:  # rotary positions restart at each document
            positions = llama.segment_positions(segments)
        policy, unrolled = REMAT_POLICIES[self.cfg.remat], not self.cfg.scan_layers
        stats = []
        for stack, run in self.layer_runs():  # one run without dense layers: the whole stack
            block_def, stack_state = nnx.split(stack)
            total = jax.tree.leaves(stack_state)[0].shape[0]

            def layer(x: jax.Array, state: nnx.State, block_def: Any = block_def) -> Any:
                out = nnx.merge(block_def, state)(x, positions, segments)
                return out if isinstance(out, tuple) else (out, None)  # a dense block: no stats

            x, run_stats = scan_layers(
                layer, x, layer_groups.rows(stack_state, run, total), policy, unrolled
            )
            if not run.dense:
                stats.append(run_stats)
        # the sparse layers' statistics in model order, stacked on a leading layers dim
        return x, jax.tree.map(lambda *parts: jnp.concatenate(parts), *stats)


create_moe = creator(MoELlama)  # (cfg, seed, dtype) -> a freshly initialised MoELlama


def create(cfg: LlamaConfig, seed: int, dtype: Any = jnp.float32) -> llama.Llama:
    """A freshly initialised model: MoELlama, or llama.Llama for a dense config (a LlamaConfig,
    or n_experts 0)."""
    if not isinstance(cfg, MoEConfig) or not cfg.n_experts:
        return llama.create(cfg, seed, dtype)
    return create_moe(cfg, seed, dtype)


def router_loss(cfg: MoEConfig, stats: dict) -> jax.Array:
    """aux_loss_coef x load-balancing loss + z_loss_coef x z-loss, averaged over layers."""
    return cfg.aux_loss_coef * stats["aux_loss"].mean() + cfg.z_loss_coef * stats["z_loss"].mean()


def lm_loss(model: llama.Llama, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (nats per token, fp32) plus the router losses; the
    optional batch keys "segments" and "weights" act as in llama.lm_loss."""
    if not isinstance(model, MoELlama):
        return llama.lm_loss(model, batch)
    x, stats = model.apply_blocks_with_stats(
        model.embed_tokens(batch["inputs"]), batch.get("segments")
    )
    losses = model.token_losses(x, batch["targets"])  # fused over vocabulary chunks or not
    if "weights" in batch:  # the SFT loss mask, scaled as llama.lm_loss takes it
        losses = losses * batch["weights"]
    return jnp.mean(losses) + router_loss(model.cfg, stats)


def router_stats(model: MoELlama, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """What a log record shows of the router on `batch`, averaged over layers: aux_loss,
    z_loss, dropped_fraction (of the (token, choice) pairs), expert_load_max_over_mean (the
    busiest expert's choices over the mean; 1 is even); the last two per layer too (_by_layer:
    the sparse layers in model order; a dense-MLP layer has no router)."""
    _, stats = model.forward(batch["inputs"], batch.get("segments"))
    load = stats["load"].max(-1) / stats["load"].mean(-1)  # [layers]
    return {
        "aux_loss": stats["aux_loss"].mean(),
        "z_loss": stats["z_loss"].mean(),
        "dropped_fraction": stats["dropped"].mean(),
        "expert_load_max_over_mean": load.mean(),
        "dropped_fraction_by_layer": stats["dropped"],  # [layers]
        "expert_load_max_over_mean_by_layer": load,
    }
