"""models.family: the registry, configs by type and from saved sections, and the counts each
family reports against its config's own."""

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


# A Hugging Face fixture of each registered family (tests/fixtures/make_hf_*.py): a family
# registered without one fails test_every_family_keeps_the_contract below.
FIXTURES = {
    "llama": "hf_llama_untied",
    "moe": "hf_mixtral",
    "gemma2": "hf_gemma2",
    "gemma3": "hf_gemma3",
    "qwen3_moe": "hf_qwen3_moe",
    "olmo2": "hf_olmo2",
    "phi3": "hf_phi3",
}


@pytest.mark.parametrize("name", sorted(family.FAMILIES))
def test_every_family_keeps_the_contract(name):
    """Each registered family, on its Hugging Face fixture: the registry picks it from
    config.json, its config names it and saves and restores as a checkpoint's [model] section,
    `create` builds a CausalLM (the three pipeline pieces) whose blocks decode with a cache,
    and n_params() and the estimators' shape count exactly the params it builds."""
    import dataclasses
    import math
    from pathlib import Path

    from flax import nnx

    from spmd.estimate import shape

    fam = family.get(name)
    folder = Path(__file__).resolve().parent / "fixtures" / FIXTURES[name]
    checkpoint = family.open_hf(str(folder))  # headers only
    cfg = checkpoint.config
    assert checkpoint.family == name and family.of(cfg) is fam and cfg.family == name
    assert family.config_from_dict(dataclasses.asdict(cfg)) == cfg
    model = nnx.eval_shape(lambda: fam.create(cfg, 0))
    assert isinstance(model, family.CausalLM) and hasattr(model.blocks, "decode")
    built = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(built))
    assert count == fam.n_params(cfg) == shape.shape_params(fam.shape(cfg))
    fam.check(cfg)


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


@pytest.mark.parametrize("name", sorted(family.FAMILIES))
def test_every_family_trains_lora_adapters_and_logs_its_metrics(name):
    """LoRA on each registered family (its fixture's config, random weights, one device),
    through the run's own model (spmd.run.builder.run_model, as spmd.train and spmd.bench take
    it): two steps train the adapters and leave the base as it was, and the family's logged
    metrics (an MoE's router statistics) run on the LoRA model."""
    from pathlib import Path

    import numpy as np

    from spmd.observe.observer import model_metrics
    from spmd.run import builder
    from spmd.run.config import flat
    from tests import trainer

    folder = Path(__file__).resolve().parent / "fixtures" / FIXTURES[name]
    cfg = family.open_hf(str(folder)).config
    run = flat(cfg, lora_rank=2, steps=2, batch=2, seq_len=16, lr=1e-2, warmup=0)
    program = builder.program(run, trainer.layout("dp=1").mesh)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 17), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state = program.init()
    before = jax.device_get(state.params)
    state, first = program.step(state, batch)  # the state is donated
    state, second = program.step(state, batch)
    assert np.isfinite(first["loss"]) and second["loss"] < first["loss"]
    after = jax.device_get(state.params)
    frozen, trained = (
        [np.array_equal(o, n) for o, n in zip(*map(jax.tree.leaves, parts), strict=True)]
        for parts in ((before["frozen"], after["frozen"]), (before["lora"], after["lora"]))
    )
    assert all(frozen) and not all(trained)  # the base as it was, the adapters moved
    metrics = builder.run_model(run).metrics
    assert (metrics is not None) == bool(family.get(name).shape(cfg).n_experts)
    if metrics is not None:  # the MoE families: the router's statistics of the adapted model
        figures = jax.device_get(model_metrics(program, metrics)(state.params, batch))
        assert set(figures) >= {"aux_loss", "expert_load_max_over_mean"}
        assert all(np.isfinite(v) for v in figures.values())
