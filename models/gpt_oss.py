"""The GPT-OSS family (Hugging Face `GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): the
mixture-of-experts Llama of models/moe.py with GPT-OSS's attention and experts
(models/gpt_oss_layers.py).

What differs from a Llama, and which field or piece computes it:

    attention sinks: a learned logit per query head in the softmax's     SinkAttention.sinks
      denominator
    biases on q, k, v and o                                               qkv_bias, .bo
    sliding-window and full layers alternating (layer i full when        sliding_window,
      (i + 1) % global_every == 0; transformers' layer_types)             global_every
    YaRN rotary scaling and its attention factor (models/rope.py)        rope_scaling "yarn",
                                                                          rope_beta_*, ...
    every block's MLP: E experts of width expert_mlp_dim, a router        n_experts, ...
      with a bias, top-k then a softmax over the k                        norm_topk_prob true
    experts with biases, gate / up interleaved, the clamped SwiGLU        swiglu_limit,
                                                                          swiglu_alpha

Released checkpoints store the experts in MXFP4 (models/mxfp4.py); which config.json field
becomes which config field, and the tensors: models/hf_gpt_oss.py. The layers share one stack,
so the scan carries the layer's index (as Gemma's); a pipeline stage must hold whole periods
of the sliding / full pattern, and an MoE's router losses cannot cross stages (check_layout).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from models import hf_gpt_oss, llama, lora, moe
from models.attention import segment_positions
from models.contract import Family, HFMapping
from models.gemma2 import check_whole_periods
from models.gpt_oss_layers import Block
from models.layers import REMAT_POLICIES, creator
from models.moe_routing import options_set
from spmd.errors import UsageError
from spmd.model_shape import ModelShape
from spmd.parallel.hooks import document_positions, scan_layers, token_positions


@dataclasses.dataclass(frozen=True)
class GptOssConfig(moe.MoEConfig):
    """MoEConfig with GPT-OSS's fields and defaults (gpt-oss-20b's routing and rope). Sizes
    are counts; windows and positions are tokens."""

    family: str = "gpt_oss"
    # rotary scaling: yarn (GPT-OSS's, models/rope.py) or none
    rope_scaling: Literal["none", "yarn"] = "yarn"  # type: ignore[assignment]
    rope_theta: float = 150000.0
    rope_factor: float = 32.0  # yarn: the context's growth over pretraining's
    rope_original_max_positions: int = 4096  # yarn: L, the pretraining context (tokens)
    rope_beta_fast: float = 32.0  # yarn: pairs turning more than this over L keep their frequency
    rope_beta_slow: float = 1.0  # yarn: pairs turning fewer times over L are interpolated
    rope_truncate: bool = False  # yarn: the ramp's ends rounded outwards to whole pairs
    # yarn: cos and sin scale (q . k by its square); YaRN's 0.1 ln(factor) + 1 for factor 32
    rope_attention_factor: float = 0.1 * math.log(32.0) + 1.0
    qkv_bias: bool = True  # biases on q, k and v (the output bias is always there)
    sliding_window: int = 128  # positions a sliding layer sees, its own included (0: all)
    global_every: int = 2  # layer i is full when (i + 1) % this == 0 (0: every layer sliding)
    n_experts: int = 32  # experts per block (every layer is sparse)
    experts_per_token: int = 4
    norm_topk_prob: bool = True  # the softmax over the chosen k (GPT-OSS's router)
    z_loss_coef: float = 0.0  # weight of the router z-loss in the training loss (GPT-OSS: none)
    swiglu_limit: float = 7.0  # the experts' gate clamped to <= this, up to [-this, this]
    swiglu_alpha: float = 1.702  # the experts' gate x sigmoid(this x gate)

    @property
    def period(self) -> int:
        """Layers after which the sliding / full pattern repeats."""
        return self.global_every or 1

    def shape(self) -> ModelShape:
        """The MoE's sizes plus the sinks, the output bias, the router's and experts' biases;
        a pipeline also needs whole periods per stage (check_layout)."""
        return dataclasses.replace(super().shape(), attn_sinks=True, o_bias=True, expert_bias=True)


def check(cfg: GptOssConfig) -> None:
    """UsageError for settings that cannot run: the MoE family's (moe.check), the rope's, the
    window pattern's and the experts' activation's; routing GPT-OSS lacks."""
    moe.check(dataclasses.replace(cfg, rope_scaling="none"))  # the Llama's knows no yarn
    if cfg.n_experts < 1:
        raise UsageError(f"--n-experts {cfg.n_experts}: a gpt_oss model has experts (>= 1)")
    if cfg.dense_layers:  # its one stack of sink-attention blocks (GptOss.make_stacks)
        raise UsageError(
            f"--dense-layers {cfg.dense_layers!r}: every gpt_oss layer is sparse; leave it empty"
        )
    if cfg.rope_scaling not in ("none", "yarn"):
        raise UsageError(f"--rope-scaling {cfg.rope_scaling!r} is not one of none, yarn")
    if cfg.rope_scaling == "yarn":
        if not 1 <= cfg.rope_factor < math.inf:
            raise UsageError(f"--rope-factor {cfg.rope_factor} must be a finite factor >= 1")
        if cfg.rope_original_max_positions < 1:
            raise UsageError(
                f"--rope-original-max-positions {cfg.rope_original_max_positions} must be a "
                f"positive number of tokens"
            )
        for name in ("rope_beta_fast", "rope_beta_slow", "rope_attention_factor"):
            if not 0 < getattr(cfg, name) < math.inf:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be > 0")
    for name in ("swiglu_limit", "swiglu_alpha"):
        if not 0 < getattr(cfg, name) < math.inf:
            flag = name.replace("_", "-")
            raise UsageError(f"--{flag} {getattr(cfg, name)} must be positive and finite")
    for name in ("sliding_window", "global_every"):
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be >= 0")
    routing = options_set(cfg) + (["shared_expert true"] if cfg.shared_expert else [])
    if routing or cfg.dense_layers:
        raise UsageError(
            f"a gpt_oss model routes by its biased router's top-k alone, with experts in "
            f"every layer; it does not compute {', '.join(routing) or 'dense_layers'}"
        )


def check_layout(cfg: GptOssConfig, mesh: Any, executor: str) -> None:
    """UsageError for layouts it cannot run: the MoE family's (no router losses through a
    pipeline); a pipeline stage without whole periods of the sliding / full pattern (each
    counts its layers from 0); a tensor split of the experts that would cut a (gate, up)
    pair of the interleaved gate_up apart."""
    check(cfg)
    moe.check_layout(dataclasses.replace(cfg, rope_scaling="none"), mesh, executor)
    stages, tp = mesh.shape["pipeline"], mesh.shape["tensor"]
    if stages > 1 and (cfg.n_layers % stages or (cfg.n_layers // stages) % cfg.period):
        raise UsageError(
            f"pp={stages} with --n-layers {cfg.n_layers}: each pipeline stage must hold a "
            f"multiple of --global-every {cfg.period} layers; use such a pp, or pp=1"
        )
    if cfg.expert_dim % tp:
        raise UsageError(
            f"tp={tp} must divide --expert-mlp-dim {cfg.expert_dim}: each device holds whole "
            f"(gate, up) pairs of the experts' interleaved gate_up"
        )


class GptOss(moe.MoELlama):
    """moe.MoELlama with GPT-OSS blocks, each told its layer's index: tokens [batch, length]
    -> logits [batch, length, vocab] (fp32)."""

    block_type = Block  # type: ignore[assignment]  # (moe.MoELlama's is moe.Block)
    cfg: GptOssConfig

    make_stacks = llama.Llama.make_stacks  # one stack: every layer is sparse
    layer_runs = llama.Llama.layer_runs

    def apply_blocks_with_stats(
        self, x: jax.Array, segments: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        """The blocks (a scan carrying the layer's index) and their router statistics, stacked
        on a leading layers dim; with `segments` attention stays within documents."""
        check_whole_periods(self.blocks, self.cfg)
        if segments is None:
            positions = token_positions(x)  # global positions, also under SP and CP
        else:  # restarting per document, from the ids in natural order under CP too
            positions = document_positions(segments, segment_positions)
        block_def, block_state = nnx.split(self.blocks)

        def layer(carry: tuple, state: nnx.State) -> tuple[tuple, dict]:
            x, index = carry
            x, stats = nnx.merge(block_def, state)(x, positions, segments, index)
            return (x, index + 1), stats

        policy, unrolled = REMAT_POLICIES[self.cfg.remat], not self.cfg.scan_layers
        start = (x, jnp.zeros((), jnp.int32))
        (x, _), stats = scan_layers(layer, start, block_state, policy, unrolled)
        return x, stats


def config_from_hf(raw: dict[str, Any], where: str, remat: str = "none") -> GptOssConfig:
    """The config of a GPT-OSS config.json (as a dict); UsageError naming a field whose value
    spmd does not compute (models/hf_gpt_oss.py)."""
    cfg = GptOssConfig(**hf_gpt_oss.config_fields(raw, where, remat))
    check(cfg)
    return cfg


FAMILY = Family(
    name="gpt_oss",
    config=GptOssConfig,
    create=creator(GptOss),
    loss=moe.lm_loss,
    check=check,
    check_layout=check_layout,
    hf=HFMapping(
        model_types={hf_gpt_oss.MODEL_TYPE: hf_gpt_oss.ARCHITECTURE},
        config_from_hf=config_from_hf,
        config_to_hf=hf_gpt_oss.hf_config_of,
        tensors=hf_gpt_oss.TENSORS,
    ),
    step_metrics=moe.router_stats,
    lora_targets=lora.ATTENTION,  # adapters on attention: peft addresses no fused experts
)
