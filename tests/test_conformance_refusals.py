"""What spmd does not compute in a Hugging Face folder of any registered family exits 2 naming
it: each case edits one fixture's config.json (tests/hf_fixtures.edited) and spmd.convert
--from-hf refuses it in one line, writing nothing. A new family adds its cases to
UNSUPPORTED."""

import pytest

from models import family
from tests.hf_fixtures import FIXTURES, convert_error, edited

SHAPE = "has shape ({}), but config.json implies ({})"
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": None}
GLOBAL_YARN = {"full_attention": {"rope_type": "yarn", "factor": 2.0}}
LOCAL_LINEAR = {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# (fixture, config.json changes, what the one-line error names): spmd.convert exits 2 on each.
UNSUPPORTED = {
    "hf_llama_tied": {
        "architecture": ({"architectures": ["GPT2LMHeadModel"]},
                         "architecture GPT2LMHeadModel is not supported"),
        "rope-scaling": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
                         "rope type 'yarn'"),
        "bias": ({"attention_bias": True}, "attention_bias = True"),
        # transformers builds the model its model_type names: the two must agree
        "model-type-contradicts": ({"model_type": "qwen3"},
                                   "architectures names LlamaForCausalLM but model_type 'qwen3'"),
        "wrong-shape": ({"intermediate_size": 48},
                        "tensor model.layers.0.mlp.gate_proj.weight " + SHAPE.format("32, 16",
                                                                                     "48, 16")),
    },
    "hf_qwen2": {
        "qwen-sliding": ({"use_sliding_window": True}, "use_sliding_window / layer_types"),
    },
    "hf_qwen3": {"qwen3-output-bias": ({"attention_bias": True}, "attention_bias = True")},
    "hf_llama3": {
        "dynamic-rope": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        "llama3-incomplete": ({"rope_parameters": {"rope_type": "llama3", "factor": 8}},
                              "low_freq_factor"),
    },
    "hf_mistral": {"window-0": ({"sliding_window": 0},
                                "sliding_window = 0 must be a positive integer")},
    "hf_glm4_moe": {
        "dense-first": ({"first_k_dense_replace": 3}, "first_k_dense_replace = 3 must be"),
        "top-k": ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
        "rotary-share": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.1}},
                         "rotates 0 features"),
        "yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                      "partial_rotary_factor": 0.5}}, "rope type 'yarn'"),
        "gelu": ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        "shared": ({"n_shared_experts": -1}, "n_shared_experts = -1"),
        "qk-norm": ({"use_qk_norm": "yes"}, "use_qk_norm = 'yes' must be true or false"),
    },
    "hf_mixtral": {
        "jitter": ({"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1"),
        "sliding-window": ({"sliding_window": 4096}, "sliding_window = 4096"),
        "top-k": ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
        "experts": ({"num_local_experts": 8}, "gate.weight " + SHAPE.format("4, 16", "8, 16")),
    },
    "hf_gemma2": {
        "activation": ({"hidden_activation": "gelu"}, "hidden_activation = 'gelu'"),
        "untied": ({"tie_word_embeddings": False}, "tie_word_embeddings = False"),
        "layer-types": ({"layer_types": ["full_attention", "sliding_attention"] * 2},
                        "layer_types"),
        "rope-scaling": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
                         "rope type 'linear'"),
        "bidirectional": ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        "softcap": ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping = -1.0"),
    },
    "hf_gemma3": {
        "vision": ({"vision_config": {"hidden_size": 16}}, "vision_config"),
        "conditional-generation": ({"architectures": ["Gemma3ForConditionalGeneration"]},
                                   "Gemma3ForConditionalGeneration"),
        "attn-softcap": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
        "yarn": ({"rope_parameters": GLOBAL_YARN},
                 "rope type 'yarn' of the full_attention layers"),
        "local-scaling": ({"rope_parameters": LOCAL_LINEAR},
                          "rope type 'linear' of the sliding_attention layers"),
    },
    "hf_qwen3_moe": {
        # dense layers are read (hf_qwen3_moe_dense); a config that makes a layer dense whose
        # tensors are experts names the dense tensor it lacks
        "mlp-only": ({"mlp_only_layers": [1]}, "no tensor model.layers.1.mlp.gate_proj.weight"),
        "all-dense": ({"decoder_sparse_step": 3}, "leave no sparse layer"),
        "sparse-step": ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0"),
        "mlp-only-range": ({"mlp_only_layers": [2]}, "mlp_only_layers = [2] must name layers"),
        "no-experts": ({"num_experts": 0}, "num_experts = 0"),
        "window": ({"use_sliding_window": True}, "use_sliding_window / layer_types"),
        "bias": ({"attention_bias": True}, "attention_bias = True"),
        "top-k": ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
        "norm": ({"norm_topk_prob": "yes"}, "norm_topk_prob = 'yes'"),
        "width": ({"moe_intermediate_size": 12}, SHAPE.format("24, 16", "12, 16")),
    },
    "hf_gpt_oss": {
        "no-bias": ({"attention_bias": False}, "attention_bias = False"),
        "activation": ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        "dropout": ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        "layer-types": ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        "rope-type": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
                      "rope type 'llama3'"),
        "mscale": ({"rope_parameters": GPT_OSS_YARN | {"mscale": 1.0}}, "mscale = 1.0"),
        "quantization": ({"quantization_config": {"quant_method": "gptq"}},
                         "quantization_config = {'quant_method': 'gptq'}"),
        "experts": ({"num_local_experts": 8}, "router.weight " + SHAPE.format("4, 16", "8, 16")),
    },
    "hf_olmo2": {
        "attention-bias": ({"attention_bias": True}, "attention_bias = True"),
        "activation": ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        "yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        "sliding-window": ({"sliding_window": 8}, "sliding_window = 8"),
        "head-dim": ({"head_dim": 4}, "q_proj.weight " + SHAPE.format("32, 16", "16, 16")),
    },
    "hf_phi3": {
        "longrope-incomplete": ({"rope_parameters": LONGROPE},
                                "needs long_factor, a list of positive numbers"),
        "llama3-rope": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
                        "rope type 'llama3'"),
        "partial-rotary": ({"rope_parameters": {"rope_type": "default",
                                                "partial_rotary_factor": 0.75}},
                           "partial_rotary_factor = 0.75"),
        "resid-dropout": ({"resid_pdrop": 0.1}, "resid_pdrop = 0.1"),
        "attention-dropout": ({"attention_dropout": 0.05}, "attention_dropout = 0.05"),
        "window-0": ({"sliding_window": 0}, "sliding_window = 0 must be a positive integer"),
        "gelu": ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        "kv-heads": ({"num_key_value_heads": 4}, "qkv_proj.weight has shape (32, 16), but"),
    },
}  # fmt: skip


@pytest.mark.parametrize(
    "name, changes, named",
    [
        pytest.param(name, changes, named, id=f"{name}-{case}")
        for name, table in UNSUPPORTED.items()
        for case, (changes, named) in table.items()
    ],
)
def test_what_spmd_does_not_compute_exits_2_naming_it(tmp_path, capsys, name, changes, named):
    assert named in convert_error(edited(tmp_path, name, **changes), tmp_path, capsys)


def test_every_registered_family_has_refusals():
    assert {family.open_hf(str(FIXTURES / name)).family for name in UNSUPPORTED} == set(
        family.FAMILIES
    )
