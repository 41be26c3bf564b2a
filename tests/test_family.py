"""models.family: the registry, configs by type and from saved sections, and the counts each
family reports against its config's own (tests/test_conformance.py checks every registered
family on its Hugging Face fixtures: the contract, logits, training, LoRA)."""

import jax
import pytest

from models import family, llama, moe
from spmd.errors import UsageError
from spmd.model_shape import ModelShape
from spmd.run import config


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
    assert family.get("moe").n_params(experts) == experts.n_params()
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
    assert fam.shape(cfg).flops_per_token(128) == _previous_flops_per_token(cfg, 128)


def test_shape_is_the_one_model_shape():
    shape = family.get("moe").shape(preset("moe-tiny"))
    assert isinstance(shape, ModelShape) and shape.n_experts == 4 and not shape.pipelines
    assert family.get("llama").shape(preset("tiny", llama.LlamaConfig)).n_experts == 0


def test_moe_family_logs_router_statistics_and_maps_to_mixtral():
    assert family.get("moe").step_metrics is moe.router_stats
    assert family.get("llama").step_metrics is None
    assert family.get("moe").hf.config_to_hf is not family.get("llama").hf.config_to_hf


def test_counts_include_the_attention_biases_and_norms():
    """Qwen2's q/k/v biases and Qwen3's q/k norms: the config's count, the estimator's and the
    built model's agree; the biases add no matmul FLOPs; ZeRO leaves them whole over fsdp."""
    import dataclasses
    import math

    from flax import nnx

    from spmd.estimate import cost, shape

    base = preset("tiny", llama.LlamaConfig)
    cfg = dataclasses.replace(base, qkv_bias=True, qk_norm=True)
    built = nnx.state(nnx.eval_shape(lambda: llama.create(cfg, 0)), nnx.Param)
    real = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.to_pure_dict(built)))
    extras = cfg.n_layers * cfg.head_dim * (cfg.n_heads + 2 * cfg.n_kv_heads + 2)
    assert real == cfg.n_params() == base.n_params() + extras
    assert shape.shape_params(cfg.shape()) == real
    assert family.of(cfg).shape(cfg).flops_per_token(128) == base.shape().flops_per_token(128)
    mesh = {"data": 1, "pipeline": 1, "fsdp": 8, "tensor": 1}

    def per_device(c: llama.LlamaConfig) -> float:
        run = dict(precision="fp32", optimizer="adamw", batch=8, seq_len=128)
        setup = cost.Setup(shape=c.shape(), n_params=c.n_params(), mesh=mesh, zero=3, **run)
        return cost.params_per_device(setup, fsdp_shards=True)

    assert per_device(cfg) - per_device(base) == extras  # whole on every fsdp device


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"sliding_window": -1}, "--sliding-window -1"),
        ({"rope_scaling": "dynamic"}, "--rope-scaling 'dynamic'"),
        ({"rope_scaling": "linear", "rope_factor": 0.5}, "--rope-factor 0.5"),
        ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0}, "--rope-low-freq-factor 4.0"),
        ({"rope_scaling": "llama3", "rope_original_max_positions": 0}, "original-max-positions"),
    ],
)
def test_the_variants_settings_are_checked(change, flag):
    import dataclasses

    with pytest.raises(UsageError, match=flag):
        llama.check(dataclasses.replace(preset("tiny", llama.LlamaConfig), **change))


def test_architectures_belong_to_one_family_each():
    owners: dict[str, str] = {}
    for fam in family.FAMILIES.values():
        assert fam.hf is not None
        for architecture in fam.hf.architectures:
            assert owners.setdefault(architecture, fam.name) == fam.name, architecture
    assert len({f.config for f in family.FAMILIES.values()}) == len(family.FAMILIES)


def test_architectures_pick_the_family():
    assert family.for_hf({"architectures": ["MixtralForCausalLM"]}, "x").name == "moe"
    assert family.for_hf({"model_type": "qwen2"}, "x").name == "llama"
    with pytest.raises(UsageError, match="GPT2LMHeadModel is not supported; spmd converts"):
        family.for_hf({"architectures": ["GPT2LMHeadModel"]}, "x")
