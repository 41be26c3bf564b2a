"""Gemma 2 against transformers: a tiny Gemma2ForCausalLM written by `transformers` itself
(tests/fixtures/make_hf_gemma.py, run once by hand; torch and transformers are not needed
here) with soft-caps small enough to bite, a window of 4 in 16-token rows, local and global
layers twice each and query_pre_attn_scalar != head_dim gives transformers' logits and greedy
tokens on one device and on dp=2,fsdp=2,tp=2, converts HF -> spmd -> HF bit for bit, trains
alike on one device and sharded under both executors, and is costed by the planner as
compiled. Also the attention kernels' general options (traced window, scale, soft-cap)
against a brute-force mask, and the pipeline rule of models/gemma2.py. The helpers here serve
tests/test_hf_gemma3.py too."""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention, family, gemma2
from spmd import convert, generate, plan
from spmd.engine.state_layout import sharded_bytes
from spmd.engine.step import build_program
from spmd.errors import UsageError
from spmd.estimate import cost, memory, timing
from spmd.estimate.flops import hlo_dot_flops
from spmd.parallel import hooks
from spmd.run import weights
from spmd.run.builder import optimizer
from spmd.run.config import flat
from tests import trainer
from tests.test_hf import convert_round_trip, logits_of
from tests.test_hf_families import edited, loaded, reference

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAME = "hf_gemma2"
MESHES = ("dp=1", "dp=2,fsdp=2,tp=2")


def logit_difference(name: str, mesh: str, **change) -> float:
    """Max |spmd - transformers| over the fixture's logits, relative to their largest, with
    the config fields `change` altered (same weights)."""
    source = loaded(name, mesh)
    if change:
        cfg = dataclasses.replace(source.model, **change)
        program = weights.model_program(cfg, trainer.layout(mesh))
        source = weights.Loaded(cfg, program, source.params, {}, name)
    expected = reference(name)["logits"]
    logits = logits_of(source, reference(name)["input_ids"])
    return float(np.abs(logits - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("mesh", MESHES)
def test_logits_equal_those_of_transformers(mesh):
    cfg = loaded(NAME, mesh).model
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == (5.0, 3.0, 4)
    assert cfg.query_pre_attn_scalar != cfg.head_dim and cfg.global_every == 2
    difference = logit_difference(NAME, mesh)
    print(f"gemma2 {mesh}: max logit difference / max logit {difference:.2e}")
    assert difference <= 1e-4


@pytest.mark.parametrize(
    "change",
    [
        {"attn_softcap": 0.0},
        {"final_softcap": 0.0},
        {"global_every": 1},  # every layer global: no window anywhere
        {"query_pre_attn_scalar": 8.0},  # head_dim's scale
    ],
    ids=lambda change: next(iter(change)),
)
def test_the_fixture_depends_on_each_gemma_feature(change):
    """Without each feature the same weights miss transformers' logits far beyond 1e-4."""
    assert logit_difference(NAME, "dp=1", **change) > 1e-2


def test_greedy_generation_equals_that_of_transformers():
    """The key/value-cache decoder (each layer's window and base by its index) on 3-D."""
    check_greedy(NAME)


def check_greedy(name: str) -> None:
    prompts = reference(name)["input_ids"].tolist()
    expected = reference(name)["greedy_ids"]
    source = loaded(name, "dp=2,fsdp=2,tp=2")
    tokens = generate.generate(source.program, source.params, prompts, expected.shape[1])
    assert tokens == expected.tolist()


def test_hf_to_spmd_to_hf_is_bit_exact_through_the_commands(tmp_path):
    check_round_trip(NAME, tmp_path)


def check_round_trip(name: str, tmp_path: Path) -> None:
    _, source, written = convert_round_trip(FIXTURES / name, tmp_path, "dp=2,fsdp=2,tp=2")
    for key in ("architectures", "model_type", "rope_parameters", "layer_types"):
        assert written[key] == source[key], key
    read = family.for_hf(source, "source").hf.config_from_hf
    assert read(written, "back") == read(source, "source")


def train_run(name: str, mesh: str, executor: str = "auto", steps: int = 3):
    """(losses, final params, program, compiled step) of `steps` AdamW steps (ZeRO 3, fp32)
    from the fixture's weights on `mesh`, all on one batch of 8 x 16 random tokens (so the
    loss falls)."""
    folder = str(FIXTURES / name)
    cfg = family.open_hf(folder).config
    fam = family.of(cfg)
    run = flat(None, steps=steps, batch=8, seq_len=16, warmup=1, lr=3e-3)
    program = build_program(
        lambda seed: fam.create(cfg, seed),
        fam.loss,
        lambda names: optimizer(run)(names),
        trainer.layout(mesh),
        executor=executor,
    )
    step = program.compile_train_step(8, 16)
    params, opt_state, loss_scale = weights.init_from_hf(folder, program)
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 17), np.int32)
    sharding = program.layout.batch_sharding()
    batch = {
        "inputs": jax.device_put(rows[:, :-1], sharding),
        "targets": jax.device_put(rows[:, 1:], sharding),
    }
    losses = []
    for _ in range(steps):
        params, opt_state, loss_scale, metrics = step(params, opt_state, loss_scale, batch)
        losses.append(metrics["loss"])
    return np.asarray(jax.device_get(losses)), jax.device_get(params), program, step


@functools.cache
def one_device_run(name: str):
    return train_run(name, "dp=1")[:2]


def check_training(name: str, executor: str) -> None:
    """Three AdamW steps on dp=2,fsdp=2,tp=2 equal one device's; and the planner costs that
    sharded step as compiled (`check_planner`)."""
    losses, params, program, step = train_run(name, "dp=2,fsdp=2,tp=2", executor)
    one_losses, one_params = one_device_run(name)
    difference = trainer.max_relative_difference(losses, one_losses)
    print(f"{name} {executor}: 3 AdamW steps, max relative loss difference {difference:.2e}")
    assert difference <= 1e-4
    assert losses[-1] < losses[0]  # the steps train
    for (path, value), expected in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(one_params), strict=True
    ):
        np.testing.assert_allclose(value, expected, rtol=1e-3, atol=2e-5, err_msg=str(path))
    check_planner(name, program, step)


def check_planner(name: str, program, step) -> None:
    """The planner's state bytes and FLOPs of the fixture's model on dp=2,fsdp=2,tp=2 (ZeRO
    3, fp32, batch 8 x 16) against the engine's state shardings (`plan.engine_program`, as
    --measure builds it) and the dots of `step`, that layout's compiled train step."""
    cfg = family.open_hf(str(FIXTURES / name)).config
    assert cfg.n_params() == sum(x.size for x in jax.tree.leaves(loaded(name, "dp=1").params))
    mesh = {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    s = cost.Setup(shape=cfg.shape(), n_params=cfg.n_params(), mesh=mesh, zero=3,
                   precision="fp32", optimizer="adamw", batch=8, seq_len=16)  # fmt: skip
    engine_program, _ = plan.engine_program(s, cfg, jax.devices()[:8])
    engine = sharded_bytes(engine_program.abstract_params)
    engine += sharded_bytes(engine_program.abstract_opt_state)
    assert engine == sharded_bytes(program.abstract_params) + sharded_bytes(
        program.abstract_opt_state
    )
    state = memory.model_state_bytes(s)
    analytic = state["params"] + state["optimizer"]
    dots = hlo_dot_flops(step) * s.devices
    planned = timing.executed_flops(s)
    print(f"{name}: state bytes planner / engine {analytic / engine:.4f}, FLOPs planner / "
          f"compiled {planned / dots:.4f}")  # fmt: skip
    assert analytic == pytest.approx(engine, rel=1e-3)
    assert planned == pytest.approx(dots, rel=0.05)


def test_training_steps_on_a_sharded_mesh_equal_one_device_and_the_planner():
    """The explicit executor here (soft-caps, windows); tests/test_hf_gemma3.py runs auto."""
    check_training(NAME, "explicit")


def test_the_attention_options_agree_with_a_brute_force_mask():
    """causal_attention with a traced window (as inside the layer scan), a score scale and a
    soft-cap equals the band, scale and tanh written out, and notes the XLA path."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, s, 8)), jnp.float32) for s in (4, 2, 2))
    scale, cap = 12**-0.5, 2.0
    for window in (3, 0):
        kernel = jax.jit(
            lambda q, k, v, w: attention.causal_attention(q, k, v, None, w, scale, cap)
        )
        fused = kernel(q, k, v, jnp.int32(window))
        assert hooks.notes()["attention"] == "xla (soft-capping)"
        i, j = np.arange(12)[:, None], np.arange(12)[None, :]
        band = jnp.asarray((j <= i) & ((j > i - window) | (window == 0)))
        logits = jnp.einsum("btkgd,bskd->bkgts", q.reshape(2, 12, 2, 2, 8), k) * scale
        logits = jnp.where(band, cap * jnp.tanh(logits / cap), -jnp.inf)
        brute = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(logits, -1), v).reshape(q.shape)
        np.testing.assert_allclose(fused, brute, rtol=0, atol=1e-5)


def test_a_pipeline_must_hold_whole_periods_of_the_local_global_pattern():
    """check_layout accepts pp=2 for 4 layers of period 2 and refuses pp=4 (1 layer per
    stage); run as two chunks of 2 layers (what pp=2 runs) the blocks equal the whole stack,
    and a chunk of 1 layer is refused while tracing."""
    source = loaded(NAME, "dp=1")
    cfg = source.model
    gemma2.check_layout(cfg, trainer.layout("pp=2,dp=4").mesh, "auto")
    with pytest.raises(UsageError, match="multiple of --global-every 2"):
        gemma2.check_layout(cfg, trainer.layout("pp=4,dp=2").mesh, "auto")
    model = nnx.merge(source.program.graphdef, jax.device_get(source.params))
    x = model.embed_tokens(jnp.asarray(reference(NAME)["input_ids"]))
    whole = model.apply_blocks(x)
    graphdef, state = nnx.split(model)

    def chunk(start: int, size: int) -> nnx.Module:
        def cut(path, leaf):
            return leaf[start : start + size] if path[0].key == "blocks" else leaf

        return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(cut, state))

    staged = chunk(2, 2).apply_blocks(chunk(0, 2).apply_blocks(x))
    np.testing.assert_allclose(staged, whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(UsageError, match="pipeline chunk of 1 layers"):
        chunk(0, 1).apply_blocks(x)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"hidden_activation": "gelu"}, "hidden_activation = 'gelu'"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings = False"),
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping = -1.0"),
    ],
    ids=["activation", "untied", "layer-types", "rope-scaling", "bidirectional", "softcap"],
)
def test_what_gemma2_does_not_compute_exits_2_naming_it(tmp_path, capsys, changes, named):
    args = ["--from-hf", edited(tmp_path, NAME, **changes), "--to", str(tmp_path / "out")]
    assert convert.main([*args, "--mesh", "fsdp=-1"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_context_parallelism_is_refused():
    cfg = loaded(NAME, "dp=1").model
    with pytest.raises(UsageError, match="cp=2 with a gemma2 model"):
        gemma2.check_layout(cfg, trainer.layout("dp=4,cp=2").mesh, "auto")
