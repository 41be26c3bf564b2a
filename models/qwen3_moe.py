"""The Qwen3-MoE family (Hugging Face `Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B,
Qwen3-Coder-30B-A3B): the mixture-of-experts Llama of models/moe.py with Qwen3's attention.

What differs from a Llama, and which switch of the shared pieces computes it:

    per-head RMS norms of q and k over head_dim, before rotary    qk_norm (models/attention.py)
    head_dim not tied to hidden / heads                           head_dim
    every block's MLP is E SwiGLU experts and a router            moe.Experts (n_experts)
      of width moe_intermediate_size, not intermediate_size       expert_mlp_dim
    router: fp32 softmax over all E experts, the top k, used      norm_topk_prob false
      as the softmax gave them (no renormalisation to sum 1,
      unlike Mixtral) unless config.json's norm_topk_prob says
    no bias anywhere, untied head (configurable), rope default    as Llama

Mixtral differs from it only in its attention (no q/k norms) and in always renormalising the top
k weights; both run through the same MoE block, and its expert parallelism (experts over the
fsdp and expert axes, tokens sent by all-to-all), router statistics and losses. transformers
computes the router logits in the activations' dtype, spmd in fp32: the same in fp32, closer
to exact in bf16.

Released models are sparse in every layer; Qwen3-MoE's `decoder_sparse_step` /
`mlp_only_layers` (dense MLP layers between the sparse ones) become `dense_layers`, a second
stack of layers (models/layer_groups.py). Without them the stacked blocks are identical, so a
pipeline's slices of them need nothing more than the MoE family's rule (router losses off when
pp > 1, moe.check_layout); with them a pipeline is refused. Which config.json field becomes
which config field: models/hf_qwen3_moe.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models import hf_config, hf_qwen3_moe, lora, moe
from models.contract import Family, HFMapping
from spmd.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Qwen3MoEConfig(moe.MoEConfig):
    """MoEConfig with Qwen3-MoE's defaults: q/k norms, the top-k weights not renormalised,
    experts in every layer. Sizes are counts."""

    family: str = "qwen3_moe"
    qk_norm: bool = True  # RMS norm of each q and k head over head_dim, before rotary
    n_experts: int = 8  # experts per block (at least 1: every layer is sparse)
    # false: the chosen experts' weights are their softmax probabilities over all experts
    # (released Qwen3-MoE models); true: rescaled to sum to one
    norm_topk_prob: bool = False
    z_loss_coef: float = 0.0  # weight of the router z-loss in the training loss (Qwen3: none)


def check(cfg: Qwen3MoEConfig) -> None:
    """UsageError for settings that cannot run: the MoE family's (moe.check), and a model
    without experts (this family's layers are all sparse)."""
    moe.check(cfg)
    if cfg.n_experts < 1:
        raise UsageError(
            f"--n-experts {cfg.n_experts}: a qwen3_moe model has experts in every layer (>= 1); "
            f"a dense Qwen3 is --family llama --qk-norm"
        )


def check_layout(cfg: Qwen3MoEConfig, mesh: Any, executor: str) -> None:
    """UsageError for layouts it cannot run: the MoE family's (a pipeline cannot carry the
    router losses; a sliding window refuses context parallelism). Its blocks are identical,
    so any contiguous slice a pipeline stage runs is the same computation."""
    check(cfg)
    moe.check_layout(cfg, mesh, executor)


def config_from_hf(raw: dict[str, Any], where: str, remat: str = "none") -> Qwen3MoEConfig:
    """The config of a Qwen3-MoE config.json (as a dict); UsageError naming a field whose value
    spmd does not compute (models/hf_qwen3_moe.py)."""
    cfg = Qwen3MoEConfig(**hf_qwen3_moe.config_fields(raw, where, remat))
    check(cfg)
    return cfg


FAMILY = Family(
    name="qwen3_moe",
    config=Qwen3MoEConfig,
    create=moe.create_moe,
    # a pipeline's last stage scores the llama's logits_loss alone (check_layout refuses the
    # router losses)
    loss=moe.lm_loss,
    check=check,
    check_layout=check_layout,
    hf=HFMapping(
        model_types={hf_qwen3_moe.MODEL_TYPE: hf_qwen3_moe.ARCHITECTURE},
        config_from_hf=config_from_hf,
        config_to_hf=hf_qwen3_moe.hf_config_of,
        tensors=hf_config.TENSORS + hf_qwen3_moe.TENSORS,
    ),
    step_metrics=moe.router_stats,
    lora_targets=lora.ATTENTION,  # adapters on attention: the experts' weights are not targets
)
