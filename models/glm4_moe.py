"""The GLM-4.5 MoE family (Hugging Face `Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6):
the mixture-of-experts Llama of models/moe.py with GLM's attention and DeepSeek-V3's router.

What differs from a Llama, and which switch of the shared pieces computes it:

    rotary on the first partial_rotary_factor of each head's     partial_rotary_factor
      features (0.5), the rest unrotated                           (models/rope.py)
    biases on q, k and v (not o), optional per-head q/k norms    qkv_bias, qk_norm
    the first first_k_dense_replace layers dense (mlp_dim wide)  dense_layers
    the others E routed experts + n_shared_experts shared ones   n_experts, shared_expert,
      of moe_intermediate_size each (one of n x that width)        shared_expert_mlp_dim
    router: fp32 sigmoid scores, a correction bias added to      router_score sigmoid,
      choose (not to weight), group-limited top-k, the chosen      router_bias, n_group,
      weights renormalised and times routed_scaling_factor         topk_group, norm_topk_prob,
                                                                   routed_scaling_factor

No load-balancing or z-loss by default: GLM-4.5 balances by the bias (`--router-bias-rate`,
DeepSeek-V3's rule, 0 here: fine-tuning keeps the released bias). Which config.json field
becomes which config field: models/hf_glm4_moe.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from models import hf_config, hf_glm4_moe, lora, moe, rope
from models.contract import Family, HFMapping
from spmd.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Glm4MoEConfig(moe.MoEConfig):
    """MoEConfig with GLM-4.5's defaults. Sizes are counts."""

    family: str = "glm4_moe"
    # the share of each head's features that rotate (the first ones); the rest pass unrotated
    partial_rotary_factor: float = 0.5
    qkv_bias: bool = True  # biases on the q, k, v projections (config.json's attention_bias)
    n_experts: int = 8  # routed experts per sparse layer (at least 1)
    shared_expert: bool = True  # n_shared_experts shared experts, as one of their summed width
    router_score: Literal["softmax", "sigmoid"] = "sigmoid"
    router_bias: bool = True  # e_score_correction_bias
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.0  # GLM-4.5 balances by the bias, not by a loss
    z_loss_coef: float = 0.0


def check(cfg: Glm4MoEConfig) -> None:
    """UsageError for settings that cannot run: the MoE family's (moe.check), a model without
    experts, and a rotary share that leaves no pair of features or an odd count."""
    moe.check(cfg)
    if cfg.n_experts < 1:
        raise UsageError(
            f"--n-experts {cfg.n_experts}: a glm4_moe model has experts in its sparse layers "
            f"(>= 1); a dense GLM is another architecture"
        )
    rotated = rope.rotary_dims(cfg.head_dim, cfg.partial_rotary_factor)
    if not 0 < cfg.partial_rotary_factor <= 1 or rotated < 2 or rotated % 2:
        raise UsageError(
            f"--partial-rotary-factor {cfg.partial_rotary_factor} with --head-dim "
            f"{cfg.head_dim} rotates {rotated} features; it must be in (0, 1] and rotate an "
            f"even number of at least 2"
        )


def check_layout(cfg: Glm4MoEConfig, mesh: Any, executor: str) -> None:
    """UsageError for layouts it cannot run: the MoE family's (router losses or two stacks
    under a pipeline, a capacity factor under context parallelism)."""
    check(cfg)
    moe.check_layout(cfg, mesh, executor)


def config_from_hf(raw: dict[str, Any], where: str, remat: str = "none") -> Glm4MoEConfig:
    """The config of a GLM-4.5 MoE config.json (as a dict); UsageError naming a field whose
    value spmd does not compute (models/hf_glm4_moe.py)."""
    cfg = Glm4MoEConfig(**hf_glm4_moe.config_fields(raw, where, remat))
    check(cfg)
    return cfg


FAMILY = Family(
    name="glm4_moe",
    config=Glm4MoEConfig,
    create=moe.create_moe,
    loss=moe.lm_loss,
    check=check,
    check_layout=check_layout,
    hf=HFMapping(
        model_types={hf_glm4_moe.MODEL_TYPE: hf_glm4_moe.ARCHITECTURE},
        config_from_hf=config_from_hf,
        config_to_hf=hf_glm4_moe.hf_config_of,
        tensors=hf_config.TENSORS + hf_glm4_moe.TENSORS,
    ),
    step_metrics=moe.router_stats,
    lora_targets=lora.ATTENTION,  # adapters on attention: the experts' weights are not targets
)
