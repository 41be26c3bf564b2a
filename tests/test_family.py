"""models.family: the registry, configs by type and from saved sections, and the counts each
family reports against its config's own."""

import pytest

from models import family, llama, moe
from spmd import config
from spmd.errors import UsageError
from spmd.model_shape import ModelShape


def preset(name: str, cls: type = moe.MoEConfig):
    return config.build(cls, config.preset(name), name)


def test_get_names_the_valid_families():
    assert family.get("llama").config is llama.LlamaConfig
    assert family.get("moe").config is moe.MoEConfig
    with pytest.raises(UsageError, match="'gpt' is not one of llama, moe"):
        family.get("gpt")


def test_of_goes_by_config_type():
    dense = preset("tiny", llama.LlamaConfig)
    assert family.of(dense).name == "llama" and dense.family == "llama"
    assert family.of(preset("moe-tiny")).name == "moe"
    with pytest.raises(UsageError, match="no model family's config"):
        family.of(object())


def test_presets_say_their_family():
    assert config.preset("tiny")["family"] == "llama"
    assert config.preset("moe-small")["family"] == "moe"


def test_config_from_dict_new_and_old_checkpoints():
    import dataclasses

    cfg = preset("moe-tiny")
    assert family.config_from_dict(dataclasses.asdict(cfg)) == cfg
    old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "family"}
    assert family.config_from_dict(old) == cfg  # experts: "moe"
    dense_run = dataclasses.asdict(dataclasses.replace(cfg, n_experts=0))
    del dense_run["family"]  # an old dense run, saved through MoEConfig
    restored = family.config_from_dict(dense_run)
    assert type(restored) is llama.LlamaConfig and restored.family == "llama"
    with pytest.raises(UsageError, match="n_wings"):
        family.config_from_dict({**dense_run, "n_wings": 2})


def test_counts_are_the_configs():
    dense, experts = preset("tiny", llama.LlamaConfig), preset("moe-tiny")
    assert family.get("llama").n_params(dense) == dense.n_params()
    assert family.get("llama").n_active_params(dense) == dense.n_params()
    assert family.get("moe").n_params(experts) == experts.n_params()
    assert family.get("moe").n_active_params(experts) == experts.n_active_params()
    assert experts.n_active_params() < experts.n_params()


def _previous_flops_per_token(cfg, seq_len: int) -> float:
    """spmd.estimate.flops.decoder_flops_per_token before the model owned its FLOPs."""
    e, d = cfg.embed_dim, cfg.head_dim
    attention_params = e * d * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp_params = 3 * e * cfg.mlp_dim
    experts = getattr(cfg, "n_experts", 0)
    if experts:
        routed = cfg.experts_per_token + int(cfg.shared_expert)
        mlp_params = e * experts + routed * 3 * e * (cfg.expert_mlp_dim or cfg.mlp_dim)
    matmul_params = cfg.n_layers * (attention_params + mlp_params) + e * cfg.vocab_size
    return 6.0 * matmul_params + 12 * cfg.n_layers * seq_len * cfg.n_heads * d


@pytest.mark.parametrize("name", ["tiny", "1b", "moe-tiny", "moe-small"])
def test_flops_per_token_is_the_previous_formula(name):
    cfg = preset(name)
    fam = family.of(cfg)
    assert fam.flops_per_token(cfg, 128) == _previous_flops_per_token(cfg, 128)


def test_shape_is_the_one_model_shape():
    shape = family.get("moe").shape(preset("moe-tiny"))
    assert isinstance(shape, ModelShape) and shape.n_experts == 4 and not shape.pipelines
    assert family.get("llama").shape(preset("tiny", llama.LlamaConfig)).n_experts == 0


def test_param_axes_read_from_an_abstract_model():
    axes = family.get("moe").param_axes(preset("moe-tiny"))
    assert axes["blocks/experts/w_gate"] == ("layers", "expert", "embed", "mlp")
    assert axes["embed"] == ("vocab", "embed")
    dense = family.get("llama").param_axes(preset("tiny", llama.LlamaConfig))
    assert "blocks/mlp/w_up" in dense and not any("expert" in k for k in dense)


def test_moe_family_logs_router_statistics_and_maps_to_mixtral():
    assert family.get("moe").step_metrics is moe.router_stats
    assert family.get("llama").step_metrics is None
    assert family.get("moe").hf.config_to_hf is not family.get("llama").hf.config_to_hf
