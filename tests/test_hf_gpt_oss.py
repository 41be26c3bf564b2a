"""What only GPT-OSS has (tests/test_conformance.py runs the common checks on its fixture):
YaRN's frequencies against transformers', and the experts' biases and clamped SwiGLU through
every dispatch kernel against the one-hot reference, and MXFP4 experts on import."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import gpt_oss, moe_dispatch, mxfp4
from models.gpt_oss_layers import BiasedExperts
from models.rope import Rope
from spmd.errors import UsageError
from spmd.io import safetensors_io
from spmd.run import weights
from tests import trainer
from tests.hf_fixtures import FIXTURES, ONE, reference, save_random_params


def fixture_config() -> gpt_oss.GptOssConfig:
    raw = json.loads((FIXTURES / "hf_gpt_oss" / "config.json").read_text())
    return gpt_oss.config_from_hf(raw, "hf_gpt_oss")


def test_yarn_frequencies_equal_transformers():
    cfg = fixture_config()
    got = np.asarray(Rope.of(cfg).inv_freq(cfg.head_dim))
    np.testing.assert_allclose(got, reference("hf_gpt_oss")["inv_freq"], rtol=1e-6)
    plain = np.asarray(Rope(cfg.rope_theta).inv_freq(cfg.head_dim))
    ratio = got / plain  # 1: kept, 1 / factor: interpolated, between: blended
    kept, blended, interpolated = ratio[0], ratio[1:3], ratio[3:]
    assert kept == 1 and np.allclose(interpolated, 1 / cfg.rope_factor)
    assert ((1 / cfg.rope_factor < blended) & (blended < 1)).all()
    assert cfg.rope_attention_factor == 0.1 * np.log(4.0) + 1  # transformers' default for it


def biased_experts(capacity_factor: float) -> tuple[BiasedExperts, jax.Array]:
    """The fixture's experts layer (clamp 0.8) with random biases and router, and an input."""
    cfg = dataclasses.replace(fixture_config(), capacity_factor=capacity_factor)
    graph, state = nnx.split(gpt_oss.FAMILY.create(cfg, 0).blocks)
    experts = nnx.merge(graph, jax.tree.map(lambda a: a[0], state)).experts  # layer 0's
    assert isinstance(experts, BiasedExperts)
    keys = iter(jax.random.split(jax.random.key(1), 8))
    for name in ("router_logit_bias", "b_gate_up", "b_down"):
        param = getattr(experts, name)
        param[...] = jax.random.normal(next(keys), param.shape)
    experts.w_gate_up[...] = experts.w_gate_up[...] * 40  # pre-activations past the clamp
    return experts, jax.random.normal(next(keys), (2, 16, cfg.embed_dim))


def test_sorted_dispatch_with_biases_equals_the_one_hot_reference():
    for capacity_factor in (0.0, 1.0):  # dropless, and with dropped pairs
        experts, x = biased_experts(capacity_factor)
        want, want_stats = jax.jit(experts.reference)(x)  # (compiled: op by op is slower)
        got, got_stats = jax.jit(experts.sort_dispatch)(x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
        assert float(got_stats["dropped"]) == float(want_stats["dropped"])
    assert float(want_stats["dropped"]) > 0
    (gate, up, _), (b_gate, b_up, _) = experts.expert_weights()
    hidden = x @ gate[0] + b_gate[0], x @ up[0] + b_up[0]
    assert float(jnp.max(hidden[0])) > 0.8 and float(jnp.min(hidden[1])) < -0.8  # clamped


def test_the_gpu_kernel_path_with_biases_equals_the_cpu_one():
    """ragged_swiglu (GPU / TPU) and blocked_swiglu (CPU) with the experts' biases and the
    clamped SwiGLU: values and gradients for every weight and bias."""
    experts, x = biased_experts(1.0)
    _, _, _, top = experts.choose(x)
    pairs = top.reshape(x.shape[0], -1)
    cfg = experts.cfg
    kept = moe_dispatch.kept_pairs(pairs, cfg.n_experts, cfg.capacity(x.shape[1]), x.shape[1])
    matrices, biases = experts.expert_weights()
    probe = jax.random.normal(jax.random.key(3), (*pairs.shape, cfg.embed_dim))

    def loss(kernel, params):
        out = kernel(x, pairs, kept, *params, act=experts.activation)
        return jnp.sum(out * probe)

    (want, want_grads), (got, got_grads) = (
        jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(kernel, (*matrices, *biases))
        for kernel in (moe_dispatch.blocked_swiglu, moe_dispatch.ragged_swiglu)
    )
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
    for w, g in zip(want_grads, got_grads, strict=True):
        assert float(jnp.abs(w).max()) > 0
        assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max())


def test_an_mxfp4_checkpoint_reads_as_its_dequantized_experts(tmp_path):
    """A release's layout: each expert matrix as MXFP4 `_blocks` and `_scales` (random codes
    and scales around 1) and config.json's quantization_config; the import reads them as
    models.mxfp4.dequantize gives them (itself checked against transformers' in
    tests/test_mxfp4.py), the rest as stored."""
    cfg = dataclasses.replace(fixture_config(), embed_dim=32, mlp_dim=32, expert_mlp_dim=32)
    saved, _ = save_random_params(cfg, ONE, tmp_path, 1 << 30)
    path = tmp_path / "model.safetensors"
    stored = {n: np.array(t.read()) for n, t in safetensors_io.read_header(path)[0].items()}
    rng, tensors = np.random.default_rng(59), {}
    for name, value in stored.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = value
            continue
        experts, inner, out = value.shape  # [E, in, out]: blocks of 32 along `in`
        tensors[name + "_blocks"] = rng.integers(0, 256, (experts, out, inner // 32, 16), np.uint8)
        tensors[name + "_scales"] = rng.integers(120, 135, (experts, out, inner // 32), np.uint8)
    safetensors_io.write(path, [(n, v.shape, v.dtype) for n, v in tensors.items()], tensors.get)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))

    params = weights.from_hf(str(tmp_path), trainer.layout(ONE)).params
    experts = params["blocks"]["experts"]
    for layer in range(cfg.n_layers):
        for param, hf in (("w_gate_up", "gate_up_proj"), ("w_down", "down_proj")):
            name = f"model.layers.{layer}.mlp.experts.{hf}"
            want = mxfp4.dequantize(tensors[name + "_blocks"], tensors[name + "_scales"])
            np.testing.assert_array_equal(np.asarray(experts[param])[layer], want)
    np.testing.assert_array_equal(
        np.asarray(experts["b_down"]), np.asarray(saved["blocks"]["experts"]["b_down"])
    )


def test_layouts_that_would_split_a_gate_up_pair_or_a_window_period_are_refused():
    def mesh(**sizes: int) -> types.SimpleNamespace:
        axes = dict.fromkeys(("data", "pipeline", "fsdp", "expert", "context", "tensor"), 1)
        return types.SimpleNamespace(shape=axes | sizes)

    cfg = dataclasses.replace(fixture_config(), aux_loss_coef=0.0, z_loss_coef=0.0)
    gpt_oss.check_layout(cfg, mesh(tensor=8), "auto")  # 24 columns of gate and of up: 3 each
    with pytest.raises(UsageError, match="tp=16 must divide --expert-mlp-dim 24"):
        gpt_oss.check_layout(cfg, mesh(tensor=16), "auto")
    with pytest.raises(UsageError, match="multiple of --global-every 2"):
        gpt_oss.check_layout(cfg, mesh(pipeline=2), "auto")  # a sliding and a full stage
    gpt_oss.check_layout(dataclasses.replace(cfg, n_layers=4), mesh(pipeline=2), "explicit")
