"""Phi-3's own features (tests/test_conformance.py checks the hf_phi3 and hf_phi3_longrope
fixtures' logits, their window and LongRoPE factors, greedy tokens, round trip, training under
both executors, the planner, a dry run and what spmd does not compute like every family's):
the fused qkv_proj and gate_up_proj tensors split into the right params on import and their
table entries know their rows; random params go to a Phi-3 folder in several files and back
bit for bit; the llama switches a Phi-3 lacks are refused and its layers pipeline; LongRoPE's
short factors within the original length, a generation that would cross it refused, context
parallelism refused, and an explicit attention factor survives the export."""

import dataclasses
import json

import numpy as np
import pytest

from models import family, hf_phi3, hf_tensors, phi3
from spmd import generate
from spmd.errors import UsageError
from spmd.run import config, weights
from tests import trainer
from tests.hf_fixtures import (
    FIXTURES,
    MESHES,
    ONE,
    THREE_D,
    assert_params_equal,
    loaded,
    logits_of,
    reference,
    relative_difference,
    save_random_params,
)
from tests.hf_fixtures import (
    hf_tensors as read_hf,
)

PHI3, LONG = "hf_phi3", "hf_phi3_longrope"


def test_the_fused_tensors_split_at_heads_then_kv_heads_twice_and_gate_then_up():
    """Each layer's qkv_proj rows are q's (heads x head_dim), then k's and v's (kv_heads x
    head_dim each), and gate_up_proj's the gate's then up's, in the params as loaded sharded
    on dp=2,fsdp=2,tp=2 (each device holds its heads' and mlp columns' slices)."""
    cfg, params = loaded(PHI3, THREE_D).model, loaded(PHI3, THREE_D).params
    attn, mlp = params["blocks"]["attn"], params["blocks"]["mlp"]
    assert attn["wk"].addressable_shards[0].data.shape == (2, 8, 1, 4)  # layers, hid/fsdp, kv/tp
    stored = read_hf(FIXTURES / PHI3)
    assert "model.layers.0.self_attn.q_proj.weight" not in stored  # fused only
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for layer in range(cfg.n_layers):
        qkv = stored[f"model.layers.{layer}.self_attn.qkv_proj.weight"]
        assert qkv.shape == (q_rows + 2 * kv_rows, cfg.embed_dim)
        parts = {"wq": qkv[:q_rows], "wk": qkv[q_rows:][:kv_rows], "wv": qkv[q_rows + kv_rows :]}
        for name, rows in parts.items():
            value = np.asarray(attn[name][layer])  # [hid, heads, head_dim]
            np.testing.assert_array_equal(value.reshape(cfg.embed_dim, -1).T, rows, name)
        gate_up = stored[f"model.layers.{layer}.mlp.gate_up_proj.weight"]
        np.testing.assert_array_equal(np.asarray(mlp["w_gate"][layer]).T, gate_up[: cfg.mlp_dim])
        np.testing.assert_array_equal(np.asarray(mlp["w_up"][layer]).T, gate_up[cfg.mlp_dim :])


def test_a_fused_tensors_entries_know_their_rows():
    cfg = loaded(PHI3, ONE).model
    found = hf_tensors.entries(hf_tensors.param_shapes(phi3.FAMILY.create, cfg), hf_phi3.TENSORS)
    qkv = [e for e in found if e.hf_name == "model.layers.1.self_attn.qkv_proj.weight"]
    assert [(e.path[-1], e.offset, e.fused_rows) for e in qkv] == [
        ("wq", 0, 32),
        ("wk", 16, 32),
        ("wv", 24, 32),
    ]
    assert {e.hf_shape for e in qkv} == {(32, 16)}
    up = [e for e in found if e.hf_name == "model.layers.0.mlp.gate_up_proj.weight"]
    assert [(e.path[-1], e.offset, e.hf_shape) for e in up] == [
        ("w_gate", 0, (64, 16)),
        ("w_up", 32, (64, 16)),
    ]


def test_spmd_params_to_a_sharded_hf_folder_and_back_are_bit_exact(tmp_path):
    """Random params on one mesh -> a Phi-3 folder in several safetensors files (a fused tensor
    whole in one of them) -> the same params on another mesh, bit for bit."""
    cfg = loaded(PHI3, ONE).model
    params, files = save_random_params(cfg, "fsdp=2,tp=4", tmp_path / "hf", 4_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(files) > 4 and len(index["weight_map"]) == 15
    back = family.open_hf(str(tmp_path / "hf"))
    assert back.config == cfg
    target = weights.model_program(cfg, trainer.layout("dp=2,fsdp=2,tp=2"))
    assert_params_equal(family.load_hf(back, target.abstract_params), params)


def test_llama_switches_a_phi3_lacks_are_refused_and_layers_pipeline():
    """qkv biases, q/k norms and rope scalings have no Phi-3 form; the layers are all alike,
    so a pipeline (pp=2) takes them; the window composes with context parallelism (the ring
    masks it by global position, tests/test_hf_families.py's Mistral parity), LongRoPE does
    not."""
    cfg = loaded(PHI3, ONE).model
    for change, flag in (({"qk_norm": True}, "--qk-norm"), ({"rope_scaling": "linear"}, "linear")):
        with pytest.raises(UsageError, match=flag):
            phi3.check(dataclasses.replace(cfg, **change))
    phi3.check_layout(cfg, trainer.layout("pp=2,dp=4").mesh, "explicit")
    assert cfg.sliding_window
    phi3.check_layout(cfg, trainer.layout("cp=2,dp=4").mesh, "auto")
    longrope = dataclasses.replace(cfg, rope_scaling="longrope")
    with pytest.raises(UsageError, match="longrope with cp=2"):
        phi3.check_layout(longrope, trainer.layout("cp=2,dp=4").mesh, "auto")
    assert config.build(phi3.Phi3Config, dataclasses.asdict(cfg), "saved") == cfg


def test_an_explicit_attention_factor_survives_the_export():
    """transformers reads rope_scaling before rope_parameters: an attention factor other than
    the one it would derive goes there too, and comes back."""
    cfg = dataclasses.replace(loaded(LONG, ONE).model, rope_attention_factor=1.5)
    written = hf_phi3.hf_config(cfg, "float32", 64)
    assert written["rope_scaling"]["attention_factor"] == 1.5
    assert phi3.from_hf(written, "written") == cfg
    plain = hf_phi3.hf_config(loaded(LONG, ONE).model, "float32", 64)
    assert sorted(plain["rope_scaling"]) == ["long_factor", "short_factor", "type"]


@pytest.mark.parametrize("mesh", MESHES)
def test_longrope_short_rows_take_the_short_factors_as_transformers_does(mesh):
    """The first 8 tokens of 16-token rows alone (within original_max_position_embeddings 8:
    the short factors), on both meshes; the attention factor is the one transformers derives."""
    ref = reference(LONG)
    logits = logits_of(loaded(LONG, mesh), ref["short_ids"][:, :8])
    difference = relative_difference(logits, ref["short_logits"])
    print(f"phi3 longrope {mesh}: relative logit difference short {difference:.1e}")
    assert difference <= 1e-4
    cfg = loaded(LONG, ONE).model
    assert cfg.rope_attention_factor == pytest.approx((1 + np.log(4) / np.log(8)) ** 0.5)


def test_longrope_generation_crossing_the_original_length_is_refused():
    """Prompts past the original length decode with the long factors throughout, as
    transformers does (tests/test_conformance.py); a prompt within it whose generation would
    pass it is refused (transformers recomputes its cache with the long factors there)."""
    source = loaded(LONG, THREE_D)
    short_prompts = reference(LONG)["input_ids"][:, :4].tolist()
    generate.generate(source.program, source.params, short_prompts, 4)  # 8 positions: fine
    with pytest.raises(UsageError, match="generating past 8 positions"):
        generate.generate(source.program, source.params, short_prompts, 5)


def test_longrope_refuses_context_parallelism_and_a_wrong_factor_count():
    cfg = loaded(LONG, ONE).model
    with pytest.raises(UsageError, match="longrope with cp=2"):
        phi3.check_layout(cfg, trainer.layout("cp=2,dp=4").mesh, "auto")
    with pytest.raises(UsageError, match="--rope-long-factors '2.5' must be 2 positive"):
        phi3.check(dataclasses.replace(cfg, rope_long_factors="2.5"))
