"""Mixture of experts and expert parallelism (models/moe.py, the `expert` mesh axis).

Oracles: dropless fp32 loss parity with one device over expert-parallel layouts and both
executors; the dropped fraction the run reports equals a count made here from the router's
choices; the compiled all-to-all bytes equal spmd.estimate.theory's formula; each device holds
1/ep of the experts' params; FLOPs count the active params only."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import llama, moe
from spmd import train
from spmd.engine.state_layout import sharded_bytes
from spmd.engine.step import build_program
from spmd.estimate import flops, hlo, theory
from spmd.io import data
from spmd.observe.observer import model_metrics
from spmd.parallel.pipeline import Pipeline
from spmd.run import config
from spmd.run.builder import optimizer
from spmd.run.config import flat
from tests import trainer

STEPS, BATCH, SEQ_LEN = trainer.STEPS, trainer.BATCH, trainer.SEQ_LEN
# (mesh, executor, pipeline schedule or None). fsdp=2,ep=2 splits the experts over the fsdp
# and expert devices (expert parallelism sharing the data-parallel devices); pipelines carry no
# router losses, so their runs and reference train with the aux and z coefficients at 0.
# One device, and the layouts that do not split the experts, run the sorted dispatch; those
# that split them send its rows to the experts by all-to-all (models/moe_all_to_all.py), but
# under a pipeline, which keeps the one-hot dispatch with its all-to-alls (models/moe.py).
# The all-to-all layouts run under both executors; README lists the figures of the others.
# Each executor's expert split once at least (the auto executor's ep=4 and fsdp=2,ep=2 cells,
# which dp=2,ep=2,tp=2 auto covers, were cut for the suite's time: 3.3 s each)
LAYOUTS = [
    ("ep=4", "explicit", None),
    ("dp=2,ep=2,tp=2", "explicit", None),
    ("dp=2,ep=2,tp=2", "auto", None),
    ("fsdp=2,ep=2", "explicit", None),
    ("ep=2,pp=2", "auto", "gpipe"),
    # experts whole on every device: the sorted dispatch, its experts' hidden dim split by tp
    ("dp=2,tp=2", "explicit", None),
    # a sequence's chunks over context: the router's loads averaged over them too (token_mean)
    ("cp=2", "explicit", None),
]
NO_ROUTER_LOSS = {"aux_loss_coef": 0.0, "z_loss_coef": 0.0}


@functools.cache
def moe_config(**overrides: object) -> moe.MoEConfig:
    return dataclasses.replace(moe.MoEConfig(**config.preset("moe-tiny")), **overrides)


@functools.cache
def program(mesh: str, executor: str = "auto", schedule: str | None = None, **overrides: object):
    """The tiny MoE's program on `mesh`, made once per session."""
    cfg = moe_config(**overrides)
    run = flat(None, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, warmup=2, lr=3e-3)
    pipe = Pipeline(schedule, 4, 1, llama.logits_loss) if schedule else None
    return build_program(
        lambda seed: moe.create(cfg, seed),
        moe.lm_loss,
        lambda names: optimizer(run)(names),
        trainer.layout(mesh),
        executor=executor,
        pipeline=pipe,
    )


@functools.cache
def compiled(mesh: str, executor: str = "auto", schedule: str | None = None, **overrides: object):
    """(program, AOT-compiled train step) of the tiny MoE on `mesh`, made once per session."""
    prog = program(mesh, executor, schedule, **overrides)
    return prog, prog.compile_train_step(BATCH, SEQ_LEN)


def losses(mesh: str, executor: str = "auto", schedule: str | None = None, **overrides: object):
    prog, step = compiled(mesh, executor, schedule, **overrides)
    return trainer.train_losses(prog, STEPS, initial_state(), step)[0]


@functools.cache
def initial_state() -> tuple:
    return jax.device_get(tuple(program("dp=1").init()))


def test_dropless_loss_parity_with_one_device_over_expert_layouts():
    reference = losses("dp=1")
    assert reference[-1] < reference[0] - 0.5  # it trains, so parity is not trivial
    without_router_loss = losses("dp=1", **NO_ROUTER_LOSS)
    assert np.abs(without_router_loss - reference).max() > 1e-4  # the router losses count
    worst = {}
    for mesh, executor, schedule in LAYOUTS:
        if schedule:
            got = losses(mesh, executor, schedule, **NO_ROUTER_LOSS)
            worst[(mesh, executor)] = trainer.max_relative_difference(got, without_router_loss)
        else:
            got = losses(mesh, executor)
            worst[(mesh, executor)] = trainer.max_relative_difference(got, reference)
    assert max(worst.values()) <= 1e-5, worst


def test_the_sequence_wise_aux_loss_trains_on_dp2_ep2_as_on_one_device():
    """--aux-loss-scope sequence: per-sequence loads on each device (a split sequence's chunks
    summed), the mean over sequences across them (batch_mean); 5 steps equal one device's,
    and differ from the batch scope's."""
    runs = {}
    for mesh, executor in (("dp=1", "auto"), ("dp=2,ep=2", "explicit"), ("cp=2", "explicit")):
        prog, step = compiled(mesh, executor, aux_loss_scope="sequence")
        runs[mesh] = trainer.train_losses(prog, 5, initial_state(), step)[0]
    for mesh in ("dp=2,ep=2", "cp=2"):
        assert trainer.max_relative_difference(runs[mesh], runs["dp=1"]) <= 1e-5, mesh
    prog, step = compiled("dp=1", "auto")
    batch_scope = trainer.train_losses(prog, 5, initial_state(), step)[0]
    assert np.abs(batch_scope - runs["dp=1"]).max() > 1e-4


def test_capacity_drops_the_same_pairs_over_the_all_to_all_as_on_one_device():
    """With --capacity-factor 1.25 (capacity 20 of a sequence's 64 pairs per expert) pairs
    drop (2.9% on the first batch; the losses differ from dropless ones by 10x the bound
    below), and the all-to-all drops the same ones as one device: the same losses (ep=4 at
    capacity 1.0 reports the dropped fraction of an independent count, the test below)."""
    capped = {"capacity_factor": 1.25}
    reference = losses("dp=1", **capped)
    assert np.abs(reference - losses("dp=1")).max() > 1e-4
    mesh, executor = "dp=2,ep=2,tp=2", "auto"
    got = losses(mesh, executor, **capped)
    assert trainer.max_relative_difference(got, reference) <= 1e-5
    # each device decides its own sequences' drops: nothing gathered or permuted for it
    # (a batch-indexed scatter in kept_pairs once all-gathered the choices under auto)
    prog, step = compiled(mesh, executor, **capped)
    kinds = {c.kind for c in hlo.collectives(step, prog.layout.mesh)}
    assert not kinds & {"all-gather", "collective-permute"}, kinds


def test_all_to_all_bytes_match_the_formula_and_experts_are_split_ep_ways():
    for mesh, executor in (
        ("ep=4", "auto"),
        ("dp=2,ep=2,tp=2", "explicit"),
        ("dp=2,ep=2,tp=2", "auto"),
        ("fsdp=2,ep=2", "explicit"),
    ):
        prog, step = compiled(mesh, executor)
        found = [c for c in hlo.collectives(step, prog.layout.mesh) if c.kind == "all-to-all"]
        shape = moe_config().shape()
        want = theory.expert_all_to_all(shape, prog.layout.mesh, BATCH, SEQ_LEN, element_bytes=4)
        measured = sum(c.bytes * c.count for c in found)
        assert measured == want["bytes"], (mesh, executor, found)
        assert sum(c.count for c in found) == want["count"], (mesh, executor)
        assert want["bytes_per_layer"] * moe_config().n_layers == want["bytes"]
        # the sorted rows' padded all-to-all: each device sends each of the 4 devices that
        # split the experts (2 under ep=2) a block of its 4 (8) sequences x 32 tokens x
        # min(k, local experts) rows of embed 32 x 4 bytes, 4 times a layer, and once the
        # 4 experts' int32 counts (what tells the one-hot buffer's all-to-alls apart)
        sizes = prog.layout.mesh.shape
        ways = sizes["expert"] * sizes["fsdp"]
        rows = BATCH // (ways * sizes["data"]) * SEQ_LEN * min(2, 4 // ways)
        assert want["bytes_per_layer"] == 4 * (ways * rows * 32 * 4) + 4 * 4
        assert [c.bytes for c in found if c.dtype == "s32"] == [4 * 4]
        axes = {"fsdp", "expert"} if "fsdp" in mesh else {"expert"}
        assert {a for c in found for a in c.axes} == axes

        names = jax.tree.leaves(prog.names, is_leaf=lambda x: isinstance(x, tuple))
        params = jax.tree.leaves(prog.abstract_params)
        experts = [p for n, p in zip(names, params, strict=True) if "expert" in n]
        assert len(experts) == 3  # gate, up, down
        total = sum(math.prod(p.shape) * 4 for p in experts)
        ways = 4  # ep=4; fsdp=2 x ep=2; ep=2 x tp=2 inside each expert
        assert sharded_bytes(experts) * ways == total


def independent_dropped_fraction(cfg: moe.MoEConfig, params: dict, tokens: np.ndarray) -> float:
    """The share of (token, choice) pairs over capacity, counted in numpy from the router's
    top-k choices of each layer (token order within each sequence), averaged over layers."""
    model = nnx.merge(program("dp=1", capacity_factor=cfg.capacity_factor).graphdef, params)
    block_def, block_state = nnx.split(model.blocks)
    x = model.embed_tokens(jnp.asarray(tokens))
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    capacity = math.ceil(
        cfg.capacity_factor * tokens.shape[1] * cfg.experts_per_token / cfg.n_experts
    )
    shares = []
    for layer in range(cfg.n_layers):
        block = nnx.merge(block_def, jax.tree.map(lambda a, i=layer: a[i], block_state))
        hidden = block.mlp_norm(x + block.attn(block.attn_norm(x), positions))
        logits = np.asarray(hidden, np.float64) @ np.asarray(block.experts.router[...])
        choices = np.argsort(-logits, axis=-1)[..., : cfg.experts_per_token]  # softmax keeps order
        dropped = 0
        for sequence in choices:
            taken = np.zeros(cfg.n_experts, int)
            for expert in sequence.reshape(-1):  # token-major, each token's choices in rank order
                dropped += taken[expert] >= capacity
                taken[expert] += 1
        shares.append(dropped / choices.size)
        x = block(x, positions)[0]
    return float(np.mean(shares))


def test_router_top_k_equals_lax_top_k_and_keeps_the_batch_sharded():
    """models.moe.top_k gives lax.top_k's values and indices (ties to the lower index), and
    compiled over a batch split 4 ways it gathers nothing, where lax.top_k all-gathers."""
    rng = np.random.default_rng(0)
    probs = jnp.asarray(rng.integers(0, 4, (8, 16, 6)) / 4, jnp.float32)  # many ties
    for k in (1, 2, 6):
        for got, want in zip(moe.top_k(probs, k), jax.lax.top_k(probs, k), strict=True):
            np.testing.assert_array_equal(got, want)
    mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])
    split = jax.device_put(probs, jax.NamedSharding(mesh, jax.P("expert")))
    for top_k, gathers in ((moe.top_k, False), (jax.lax.top_k, True)):
        compiled = jax.jit(lambda x, top_k=top_k: top_k(x, 2)).lower(split).compile()
        kinds = {c.kind for c in hlo.collectives(compiled, mesh)}
        # lax.top_k not gathering any more (a newer JAX) would make the sort unneeded
        assert ("all-gather" in kinds) == gathers, (top_k, kinds)


def test_reported_dropped_fraction_equals_an_independent_count():
    cfg = moe_config(capacity_factor=1.0)
    assert cfg.capacity(SEQ_LEN) == 16  # 32 tokens x 2 choices over 4 experts, no slack
    prog = program("ep=4", "auto", capacity_factor=1.0)
    params = jax.device_put(
        initial_state()[0], jax.tree.map(lambda a: a.sharding, prog.abstract_params)
    )
    ids = data.train_window_ids(0, 0, BATCH, trainer.windows().n_train)
    batch = data.global_batch(trainer.windows(), ids, prog.layout.batch_sharding())
    reported = jax.device_get(model_metrics(prog, moe.router_stats)(params, batch))
    expected = independent_dropped_fraction(cfg, initial_state()[0], np.asarray(batch["inputs"]))
    assert expected > 0.01  # the capacity does drop tokens here
    assert reported["dropped_fraction"] == pytest.approx(expected, abs=1e-6)
    assert reported["expert_load_max_over_mean"] >= 1.0
    dropless = jax.device_get(
        model_metrics(program("ep=4", "auto"), moe.router_stats)(params, batch)
    )
    assert dropless["dropped_fraction"] == 0.0


def test_train_records_hold_per_layer_router_figures_and_the_report_draws_them(tmp_path, capsys):
    """Each logged train record of a moe-tiny run holds the load max / mean and the dropped
    fraction of each layer, whose means are the averaged keys; spmd.report draws a panel for
    each (the dropped fraction only where choices drop, as here at capacity factor 1)."""
    from matplotlib import image

    from spmd import report
    from tests.cli import records, train_in_process

    metrics = tmp_path / "m.jsonl"
    argv = ["--model", "moe-tiny", "--seq-len", "32", "--batch", "16", "--steps", "4"]
    result = train_in_process(
        *argv, "--log-every", "2", "--eval-every", "0", "--capacity-factor", "1",
        "--mesh", "dp=2,ep=2", "--metrics", str(metrics),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    train_records = [r for r in records(metrics) if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [2, 4]
    layers = moe_config().n_layers
    for record in train_records:
        for key in ("expert_load_max_over_mean", "dropped_fraction"):
            by_layer = record[f"{key}_by_layer"]
            assert len(by_layer) == layers and all(isinstance(v, float) for v in by_layer)
            assert np.mean(by_layer) == pytest.approx(record[key], rel=1e-6, abs=1e-7)
        assert min(record["expert_load_max_over_mean_by_layer"]) >= 1.0
        assert max(record["dropped_fraction_by_layer"]) > 0  # capacity 16 of 32 x 2 / 4: drops
    panels = [field for field, _ in report.layer_panels_of([("r", report.load_segments(metrics))])]
    assert panels == ["expert_load_max_over_mean_by_layer", "dropped_fraction_by_layer"]
    png = tmp_path / "report.png"
    assert report.main([str(metrics), "--out", str(png)]) == 0
    height, width, _ = image.imread(png).shape
    assert width >= 5 * (len(report.PANELS) + 2) * 100 - 10 and height > 300  # 7 panels
    assert "1 run(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"  # a per-layer figure that is not a list of numbers
    field = '"dropped_fraction_by_layer": ['
    bad.write_text(metrics.read_text().replace(field, f'{field}"0", ', 1))
    assert report.main([str(bad), "--out", str(png)]) == 2
    assert "is not a metrics record" in capsys.readouterr().err


def test_flops_count_active_params_only():
    cfg = moe_config()
    per_token = flops.decoder_flops_per_token(cfg, SEQ_LEN)
    norms = cfg.embed_dim * (2 * cfg.n_layers + 1)
    embedding = cfg.vocab_size * cfg.embed_dim  # a lookup, not a matmul
    attention_scores = 12 * cfg.n_layers * SEQ_LEN * cfg.n_heads * cfg.head_dim
    assert per_token == 6 * (cfg.n_active_params() - norms - embedding) + attention_scores
    assert cfg.n_active_params() < cfg.n_params()


@pytest.mark.parametrize(
    "args,message",
    [
        (("--mesh", "dp=2,ep=2,pp=2"), "cannot carry the MoE router losses"),
        (("--mesh", "ep=8"), "does not divide expert=4"),
        (("--experts-per-token", "5"), "need 1 <= experts-per-token <= n-experts"),
        (("--capacity-factor", "-1"), "--capacity-factor -1.0 must be >= 0"),
    ],
)
def test_unsupported_moe_settings_exit_2(tmp_path, capsys, args, message):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 200)
    argv = ["--model", "moe-tiny", "--data", str(text), "--data-cache", str(tmp_path)]
    assert train.main([*argv, "--batch", "16", "--seq-len", "16", "--dry-run", *args]) == 2
    assert message in capsys.readouterr().err


def test_bf16_experts_split_beside_data_replicas_compile():
    """moe-tiny dp=2,ep=2 in bf16: the sum of the experts' weight gradients over `data` once
    aborted XLA:CPU's compile (its all-reduce promotion rejects the reduction jax emits for it,
    spmd.parallel.expert_exchange.varying); a real process, as that abort kills its process."""
    from tests.cli import run

    args = ["--model", "moe-tiny", "--mesh", "dp=2,ep=2", "--zero", "0", "--precision", "bf16"]
    result = run("spmd.train", *args, "--batch", "8", "--seq-len", "32", "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
