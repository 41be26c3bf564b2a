"""An MoE's dense-MLP layers as their own stack (models/layer_groups.py): the field's text, the
runs of one kind, Qwen3-MoE's config.json rule, and a model whose runs are cut from its stacks
computing what the same layers run one by one compute. (The Hugging Face fixture
hf_qwen3_moe_dense checks them against transformers: tests/test_conformance.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import hf_qwen3_moe, layer_groups, moe
from spmd.errors import UsageError

TINY = moe.MoEConfig(
    vocab_size=64, embed_dim=16, mlp_dim=40, n_layers=5, n_heads=2, n_kv_heads=1, head_dim=8,
    n_experts=4, experts_per_token=2, expert_mlp_dim=8, dense_layers="0,3",
)  # fmt: skip


def test_the_text_names_layers_and_reads_back():
    assert layer_groups.dense_layer_set("0-2, 9", 12) == (0, 1, 2, 9)
    assert layer_groups.dense_layer_set("", 12) == ()
    assert layer_groups.layer_text([9, 0, 2, 1]) == "0-2,9"
    for text in ("0-2,9", "3", "1,3,5-7"):
        assert layer_groups.layer_text(layer_groups.dense_layer_set(text, 12)) == text


@pytest.mark.parametrize(
    "text, named",
    [("12", "from 0 to 11"), ("3-1", "low <= high"), ("a", "not a layer index"),
     ("0-11", "every one of the 12 layers")],
)  # fmt: skip
def test_a_bad_text_is_refused_naming_it(text, named):
    with pytest.raises(UsageError, match=named):
        layer_groups.dense_layer_set(text, 12)


def test_runs_follow_the_model_order_with_rows_of_each_stack():
    runs = layer_groups.runs((0, 1, 2, 9), 12)
    assert [(r.dense, r.start, r.count, r.first) for r in runs] == [
        (True, 0, 3, 0), (False, 0, 6, 3), (True, 3, 1, 9), (False, 6, 2, 10),
    ]  # fmt: skip
    assert layer_groups.stack_layers((0, 1, 2, 9), 12, True) == [0, 1, 2, 9]
    assert layer_groups.runs((), 4) == [layer_groups.Run(False, 0, 4, 0)]


@pytest.mark.parametrize(
    "step, listed, n_layers, dense",
    # the dense layers transformers 5.24's Qwen3MoeDecoderLayer builds for each config
    [(2, [], 6, "0,2,4"), (1, [0, 3], 5, "0,3"), (3, [1], 7, "0-1,3-4,6"), (1, [], 4, "")],
)  # fmt: skip
def test_qwen3_moe_config_json_gives_transformers_dense_layers(step, listed, n_layers, dense):
    raw = {"num_hidden_layers": n_layers, "decoder_sparse_step": step, "mlp_only_layers": listed}
    assert hf_qwen3_moe.dense_layers_of(raw, "config.json") == dense


def test_the_model_is_its_layers_run_in_order():
    """The runs cut from two stacks compute what each layer, taken from its stack and applied in
    model order, computes; the params are those the shape counts; statistics come from the
    sparse layers only."""
    model = moe.create(TINY, 0)
    params = nnx.to_pure_dict(nnx.state(model))
    assert sum(a.size for a in jax.tree.leaves(params)) == TINY.n_params()
    assert params["dense_blocks"]["mlp"]["w_gate"].shape == (2, 16, 40)
    assert params["blocks"]["experts"]["w_gate"].shape == (3, 4, 16, 8)
    tokens = jnp.arange(24).reshape(2, 12) % 64
    logits, stats = nnx.jit(lambda m, t: m.forward(t))(model, tokens)
    assert stats["load"].shape == (3, 4)

    @nnx.jit
    def layer_by_layer(model: moe.MoELlama, tokens: jax.Array) -> jax.Array:
        x = model.embed_tokens(tokens)
        positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
        rows = {True: 0, False: 0}
        for layer in range(TINY.n_layers):
            dense = layer in (0, 3)
            stack = model.dense_blocks if dense else model.blocks
            graph, state = nnx.split(stack)
            one = nnx.merge(graph, jax.tree.map(lambda a, i=rows[dense]: a[i], state))
            out = one(x, positions)
            x = out if dense else out[0]
            rows[dense] += 1
        return model.head_logits(x)

    np.testing.assert_allclose(logits, layer_by_layer(model, tokens), rtol=1e-6, atol=1e-6)
    # a different set of dense layers is another model
    other = moe.create(dataclasses.replace(TINY, dense_layers="0,2"), 0)
    assert not np.allclose(nnx.jit(lambda m, t: m(t))(other, tokens), logits, atol=1e-3)


def test_dense_layers_need_experts_and_one_stack_per_stage():
    with pytest.raises(UsageError, match="needs --n-experts > 0"):
        moe.check(dataclasses.replace(TINY, n_experts=0))
    assert not TINY.shape().pipelines  # the planner keeps pp = 1
    assert TINY.shape().dense_layers == 2 and TINY.shape().sparse_layers == 3
    dense_mlp = 3 * TINY.embed_dim * TINY.mlp_dim
    all_sparse = dataclasses.replace(TINY, dense_layers="")
    expert = 3 * TINY.embed_dim * TINY.expert_dim
    per_sparse = TINY.embed_dim * TINY.n_experts + TINY.n_experts * expert
    assert all_sparse.n_params() - TINY.n_params() == 2 * (per_sparse - dense_mlp)


def test_lora_adapts_both_stacks_and_peft_numbers_them_by_model_layer(tmp_path):
    """LoRA on a model of two stacks: each target gets an adapter on each stack (its twin on
    the dense one); the adapted model equals the merged one; peft's tensors are numbered by
    the model's layers and read back to the same adapters."""
    from models import family, lora, peft

    tensors = family.hf_of(TINY).tensors
    spec = lora.Spec(
        rank=2, alpha=4.0, targets={"q": lora.ATTENTION["q"], "o": lora.ATTENTION["o"]}
    )
    model = lora.wrap(moe.create(TINY, 0), spec, tensors, seed=0)
    adapters = nnx.to_pure_dict(nnx.state(model.lora))
    assert set(adapters) == {"q", "q@dense", "o", "o@dense"}
    assert adapters["q"]["a"].shape[0] == 3 and adapters["q@dense"]["a"].shape[0] == 2
    rng = np.random.default_rng(0)  # B starts at zero: draw every value so the layers differ
    adapters = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), adapters)
    nnx.replace_by_pure_dict(nnx.state(model.lora), adapters)
    tokens = jnp.arange(24).reshape(2, 12) % 64
    np.testing.assert_allclose(model(tokens), model.merged()(tokens), rtol=2e-5, atol=2e-5)

    dense = TINY.dense_layer_set()
    found = peft.peft_tensors(adapters, spec, tensors, dense)
    q = "base_model.model.model.layers.{}.self_attn.q_proj.lora_A.weight"
    assert [k for k in found if k.endswith("q_proj.lora_A.weight")] == [
        q.format(i) for i in range(5)
    ]
    np.testing.assert_array_equal(found[q.format(3)], adapters["q@dense"]["a"][1].reshape(-1, 2).T)
    np.testing.assert_array_equal(found[q.format(4)], adapters["q"]["a"][2].reshape(-1, 2).T)
    peft.save(adapters, spec, tensors, str(tmp_path / "adapter"), "base", dense)
    back = peft.load(str(tmp_path / "adapter"), spec, tensors, adapters, dense)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)
