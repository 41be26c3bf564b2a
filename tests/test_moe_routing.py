"""The router's options (models/moe_routing.py): sigmoid scores, group-limited top-k, the
routed scaling factor and the per-expert correction bias.

Oracles: a routing written here in numpy, token by token, from the rules as DeepSeek-V3 states
them (scores; groups scored by their two best biased scores; top k among the kept groups'
experts; weights the unbiased scores, renormalised, scaled) chooses the same experts with the
same weights as Experts.choose; the default (softmax, no bias, no groups) is bit for bit the
formula it was before; the loss has no gradient for the bias; the sorted dispatch equals the
one-hot reference under the new options."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import moe
from spmd.engine import precision
from spmd.engine.options import StepOptions
from spmd.engine.step import Program
from spmd.errors import UsageError
from spmd.io import data, params_io
from spmd.run import builder, config
from spmd.run.config import flat
from tests import trainer
from tests.cli import train_in_process

BATCH, LENGTH = 4, 32
# 8 experts in 4 groups of 2, the tokens' 3 experts from their 2 best groups
ROUTED = {
    "n_experts": 8,
    "experts_per_token": 3,
    "router_score": "sigmoid",
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "router_bias": True,
}
BIAS = np.array([0.3, -0.2, 0.0, 0.25, -0.3, 0.1, 0.05, -0.1], np.float32)


def tiny(**overrides: object) -> moe.MoEConfig:
    return dataclasses.replace(moe.MoEConfig(**config.preset("moe-tiny")), **overrides)


def first_experts(cfg: moe.MoEConfig, bias: np.ndarray | None = None) -> moe.Experts:
    """Layer 0's experts, the router scaled up so that the scores spread over (0, 1)."""
    graph, state = nnx.split(moe.create(cfg, 0).blocks)
    experts = nnx.merge(graph, jax.tree.map(lambda a: a[0], state)).experts
    experts.router[...] = experts.router[...] * 40.0
    if bias is not None:
        experts.router_bias[...] = jnp.asarray(bias)
    return experts


def inputs(cfg: moe.MoEConfig) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (BATCH, LENGTH, cfg.embed_dim))


def numpy_routing(
    logits: np.ndarray, cfg: moe.MoEConfig, bias: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(experts [tokens, k], weights [tokens, k]) of logits [tokens, E], one token at a time."""
    n, k = cfg.n_experts, cfg.experts_per_token
    size = n // cfg.n_group
    experts, weights = [], []
    for row in logits.astype(np.float64):
        scores = 1.0 / (1.0 + np.exp(-row))
        biased = scores + bias
        group_scores = [
            np.sort(biased[g * size : (g + 1) * size])[-2:].sum() for g in range(cfg.n_group)
        ]
        kept = np.argsort(-np.array(group_scores), kind="stable")[: cfg.topk_group]
        candidates = [e for e in range(n) if e // size in kept]
        chosen = sorted(candidates, key=lambda e: (-biased[e], e))[:k]  # ties: lower index
        w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
        experts.append(chosen)
        weights.append(w)
    return np.array(experts), np.array(weights)


def test_sigmoid_groups_bias_and_scaling_match_a_numpy_routing():
    cfg = tiny(**ROUTED)
    experts, x = first_experts(cfg, BIAS), inputs(cfg)
    logits, probs, weights, chosen = experts.choose(x)
    logits = np.asarray(logits).reshape(-1, cfg.n_experts)
    want_experts, want_weights = numpy_routing(logits, cfg, BIAS)
    np.testing.assert_array_equal(np.asarray(chosen).reshape(-1, 3), want_experts)
    np.testing.assert_allclose(np.asarray(weights).reshape(-1, 3), want_weights, rtol=1e-6)
    # the load-balancing probabilities: the sigmoid scores normalised per token
    scores = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(
        np.asarray(probs).reshape(-1, 8), scores / scores.sum(-1, keepdims=True), rtol=1e-6
    )
    # the groups and the bias each change the choice of some tokens: the test can fail
    without_groups = numpy_routing(logits, dataclasses.replace(cfg, topk_group=4), BIAS)[0]
    without_bias = numpy_routing(logits, cfg, np.zeros_like(BIAS))[0]
    assert (without_groups != want_experts).any(axis=1).mean() > 0.05
    assert (without_bias != want_experts).any(axis=1).mean() > 0.05


def test_the_default_routing_is_bit_for_bit_the_softmax_top_k():
    for normalise in (True, False):
        cfg = tiny(norm_topk_prob=normalise)
        experts, x = first_experts(cfg), inputs(cfg)
        logits, probs, weights, chosen = experts.choose(x)
        want_probs = jax.nn.softmax(logits, axis=-1)
        top, want_experts = moe.top_k(want_probs, cfg.experts_per_token)
        want = top / top.sum(axis=-1, keepdims=True) if normalise else top
        np.testing.assert_array_equal(np.asarray(probs), np.asarray(want_probs))
        np.testing.assert_array_equal(np.asarray(weights), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(chosen), np.asarray(want_experts))


def test_the_loss_has_no_gradient_for_the_bias_and_the_router_has_one():
    cfg = tiny(**ROUTED)
    experts, x = first_experts(cfg, BIAS), inputs(cfg)
    graph, state = nnx.split(experts)

    def loss(state: nnx.State) -> jax.Array:
        y, stats = nnx.merge(graph, state)(x)
        return jnp.mean(y**2) + stats["aux_loss"]

    grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(state))
    assert not np.asarray(grads["router_bias"]).any()
    assert np.abs(np.asarray(grads["router"])).max() > 0


def test_sorted_dispatch_equals_the_one_hot_reference_under_the_routing_options():
    for capacity_factor in (0.0, 1.25):
        cfg = tiny(**ROUTED, capacity_factor=capacity_factor)
        experts, x = first_experts(cfg, BIAS), inputs(cfg)
        want, want_stats = experts.reference(x)
        got, got_stats = experts.sort_dispatch(x)
        scale = float(jnp.abs(want).max())
        assert float(jnp.abs(got - want).max()) <= 1e-5 * scale
        for key in ("aux_loss", "z_loss", "dropped", "load"):
            np.testing.assert_allclose(got_stats[key], want_stats[key], rtol=1e-6, atol=1e-7)
        assert (float(got_stats["dropped"]) > 0) == (capacity_factor > 0)


def numpy_sequence_loss(logits: np.ndarray, cfg: moe.MoEConfig, bias: np.ndarray) -> float:
    """DeepSeek-V3's complementary sequence-wise balance loss of logits [b, t, E], as its paper
    states it: per sequence sum_i f_i P_i, f_i = E / (k T) x the sequence's choices of i, P_i
    the mean over its T tokens of the scores normalised per token; averaged over sequences."""
    n, k = cfg.n_experts, cfg.experts_per_token
    losses = []
    for sequence in logits.astype(np.float64):
        chosen = numpy_routing(sequence, cfg, bias)[0]
        f = n / (k * len(sequence)) * np.bincount(chosen.reshape(-1), minlength=n)
        scores = 1.0 / (1.0 + np.exp(-sequence))
        p = (scores / scores.sum(-1, keepdims=True)).mean(0)
        losses.append(float(np.sum(f * p)))
    return float(np.mean(losses))


def test_the_sequence_wise_aux_loss_matches_deepseek_v3s_formula_in_numpy():
    """aux_loss_scope "sequence": both dispatches report the numpy loss; it is not the batch
    loss (whose value is k x its own at an even load), which stays the Switch formula."""
    cfg = tiny(**ROUTED, aux_loss_scope="sequence")
    experts, x = first_experts(cfg, BIAS), inputs(cfg)
    logits = np.asarray(experts.choose(x)[0])
    want = numpy_sequence_loss(logits, cfg, BIAS)
    for _, stats in (experts(x), experts.reference(x)):
        assert float(stats["aux_loss"]) == pytest.approx(want, rel=1e-6)
    batch = first_experts(tiny(**ROUTED), BIAS)
    _, probs, _, chosen = batch.choose(x)
    share = np.bincount(np.asarray(chosen).reshape(-1), minlength=8) / (BATCH * LENGTH)
    batch_loss = float(batch(x)[1]["aux_loss"])
    assert batch_loss == pytest.approx(8 * np.sum(share * np.asarray(probs).mean((0, 1))), 1e-6)
    # the sequences' loads differ from the batch's: the two scopes measure different things
    assert abs(want - batch_loss / cfg.experts_per_token) > 1e-3


def test_a_wider_shared_expert_is_built_and_counted_at_its_width():
    """shared_expert_mlp_dim (DeepSeek's n_shared_experts x its expert width): the shared MLP
    has that width, and the shape's params, active params and FLOPs count exactly it."""
    narrow = tiny(shared_expert=True)
    wide = tiny(shared_expert=True, shared_expert_mlp_dim=3 * narrow.expert_dim)
    for cfg in (narrow, wide):
        model = moe.create(cfg, 0)
        counted = sum(a.size for a in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model))))
        assert counted == cfg.n_params() == cfg.shape().n_params()
    shared = nnx.to_pure_dict(nnx.state(moe.create(wide, 0)))["blocks"]["experts"]["shared"]
    assert {a.shape[-1] for a in jax.tree.leaves(shared)} >= {3 * narrow.expert_dim}
    extra = narrow.n_layers * 3 * narrow.embed_dim * 2 * narrow.expert_dim  # 2 more widths
    assert wide.n_active_params() - narrow.n_active_params() == extra
    assert wide.shape().active_mlp_params() - narrow.shape().active_mlp_params() == extra


RATE, BATCH_RULE = 0.05, 16


def built(mesh: str, executor: str = "auto", **overrides: object) -> Program:
    """moe-tiny (DeepSeek-V3's routing, 8 experts, aux loss off) as the commands build it:
    through spmd.run.builder, which applies the bias rate's rule to the optimizer."""
    cfg = tiny(**ROUTED, aux_loss_coef=0.0, **overrides)
    spec = builder.model_spec(cfg, precision.POLICIES["fp32"])
    run = flat(None, steps=trainer.STEPS, batch=BATCH_RULE, seq_len=LENGTH, warmup=2, lr=3e-3)
    options = StepOptions(executor=executor)
    lay = trainer.layout(mesh)
    prog = builder.build(spec, builder.optimizer(run), lay, options, None, BATCH_RULE, LENGTH)
    assert isinstance(prog, Program)
    return prog


def test_the_bias_rate_steps_the_bias_by_the_sign_of_the_load_and_nothing_else():
    """Each step: bias += rate x sign(mean load - load) on that step's batch, exactly, where
    load is the choices per expert the model reports; the other params are bitwise those of
    the same step without the rule (the bias is outside the clipping and the optimizer)."""
    ruled, fixed = built("dp=1", router_bias_rate=RATE), built("dp=1")
    state = ruled.init()
    params, opt_state, scale = state
    win = trainer.windows(LENGTH)
    for step in range(3):
        ids = data.train_window_ids(0, step, BATCH_RULE, win.n_train)
        batch = data.global_batch(win, ids, ruled.layout.batch_sharding())
        load = np.array(ruled.model(params).forward(batch["inputs"])[1]["load"])  # [layers, E]
        before = np.array(params["blocks"]["experts"]["router_bias"])
        if step == 0:  # the same first step without the rule
            unruled = fixed.train_step(*jax.tree.map(jnp.copy, (params, opt_state, scale)), batch)
        params, opt_state, scale, _ = ruled.train_step(params, opt_state, scale, batch)
        after = np.asarray(params["blocks"]["experts"]["router_bias"])
        want = before + np.float32(RATE) * np.sign(load.mean(-1, keepdims=True) - load)
        np.testing.assert_array_equal(after, want.astype(np.float32))
        assert np.abs(after - before).max() == np.float32(RATE)  # it moved
        if step == 0:
            mine, theirs = jax.device_get(params), jax.device_get(unruled[0])
            for tree in (mine, theirs):
                del tree["blocks"]["experts"]["router_bias"]
            jax.tree.map(np.testing.assert_array_equal, mine, theirs)


def test_the_bias_rate_trains_on_a_split_layout_as_on_one_device():
    runs = {}
    for mesh, executor in (("dp=1", "auto"), ("dp=2,ep=2", "explicit")):
        prog = built(mesh, executor, router_bias_rate=RATE)
        runs[mesh] = trainer.train_losses(prog, 10, None, None, batch=BATCH_RULE)
    (reference, first), (got, second) = runs["dp=1"], runs["dp=2,ep=2"]
    assert trainer.max_relative_difference(got, reference) <= 1e-5
    bias = first["blocks"]["experts"]["router_bias"]
    np.testing.assert_array_equal(second["blocks"]["experts"]["router_bias"], bias)
    assert np.abs(bias).max() >= 2 * RATE  # it moved


def test_the_bias_is_checkpointed_and_a_resume_with_its_rate_is_bitwise(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 200)
    run = ["--model", "moe-tiny", "--data", str(text), "--data-cache", str(tmp_path)]
    run += ["--batch", "8", "--seq-len", "16", "--steps", "4", "--log-every", "1"]
    run += ["--eval-fraction", "0", "--mesh", "dp=2", "--aux-loss-coef", "0"]
    run += [f"--{k.replace('_', '-')}={str(v).lower()}" for k, v in ROUTED.items()]
    run += ["--router-bias-rate", str(RATE)]
    folder = str(tmp_path / "ckpt")

    def losses(name: str, *args: str) -> dict[int, float]:
        metrics = tmp_path / f"{name}.jsonl"
        done = train_in_process(*run, "--metrics", str(metrics), *args)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}

    whole = losses("whole")
    losses("first", "--checkpoint-dir", folder, "--checkpoint-every", "2", "--stop-after", "2")
    resumed = losses("resumed", "--checkpoint-dir", folder, "--resume")
    assert sorted(resumed) == [3, 4]
    assert all(resumed[step] == whole[step] for step in resumed), (resumed, whole)
    abstract = built("dp=1", router_bias_rate=RATE).abstract_params  # (nothing compiles)
    saved = params_io.restore_params(folder, 2, abstract)["blocks"]["experts"]["router_bias"]
    steps = np.asarray(saved) / np.float32(RATE)  # two updates of +-rate (or 0) from zero
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-6)
    assert np.abs(steps).max() == 2 and np.abs(steps).min() >= 0


def test_mixtral_and_qwen3_moe_exports_refuse_routing_transformers_would_not_run():
    from models import hf_mixtral, hf_qwen3_moe, qwen3_moe

    qwen = qwen3_moe.Qwen3MoEConfig(**{**config.preset("moe-tiny"), "family": "qwen3_moe"})
    for field, value in (("router_score", "sigmoid"), ("n_group", 2), ("router_bias", True)):
        mixtral = tiny(**{field: value})
        with pytest.raises(UsageError, match=f"routing .{field} {value}. has no Mixtral"):
            hf_mixtral.mixtral_hf_config(mixtral, "float32", 64)
        with pytest.raises(UsageError, match=f"routing .{field} {value}. has no Qwen3Moe"):
            hf_qwen3_moe.hf_config_of(dataclasses.replace(qwen, **{field: value}), "float32", 64)
    assert hf_mixtral.mixtral_hf_config(tiny(), "float32", 64)["num_local_experts"] == 4
    assert hf_qwen3_moe.hf_config_of(qwen, "float32", 64)["num_experts"] == 4
