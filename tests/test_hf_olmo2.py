"""OLMo 2 against transformers: tiny Olmo2ForCausalLM checkpoints written by `transformers`
itself (tests/fixtures/make_hf_olmo2.py, run once by hand; torch and transformers are not
needed here) give transformers' logits on one device and on dp=2,fsdp=2,tp=2 and its greedy
tokens, convert HF -> spmd -> HF bit for bit, train alike on one device and sharded under both
executors (tp=4 too, where the 2 kv heads are replicated), agree with the planner's state
bytes and FLOPs, and train from --init-from-hf through a pipeline. What OLMo 2 does not have
exits 2 naming it."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import family, llama, olmo2
from models.layers import HeadsRMSNorm
from spmd import convert, generate, plan, train
from spmd.engine.state_layout import sharded_bytes
from spmd.engine.step import build_program
from spmd.errors import UsageError
from spmd.estimate import cost, memory, timing
from spmd.estimate.flops import hlo_dot_flops
from spmd.io import data, tokens
from spmd.parallel.mesh import MESH_AXES, parse_mesh
from spmd.run import config, weights
from spmd.run.builder import optimizer
from spmd.run.config import flat
from tests import cli, trainer
from tests.test_hf import convert_round_trip, logits_of

FIXTURES = Path(__file__).resolve().parent / "fixtures"
OLMO2, TIED = FIXTURES / "hf_olmo2", FIXTURES / "hf_olmo2_tied"


@functools.cache
def reference(folder: Path) -> dict[str, np.ndarray]:
    return dict(np.load(folder / "reference.npz"))


@functools.cache
def loaded(folder: Path, mesh: str) -> weights.Loaded:
    return weights.from_hf(str(folder), trainer.layout(mesh))


@pytest.mark.parametrize(
    "folder, mesh",
    [(OLMO2, "dp=1"), (OLMO2, "dp=2,fsdp=2,tp=2"), (TIED, "dp=1")],
    ids=["untied-1", "untied-dp2-fsdp2-tp2", "tied-1"],
)
def test_logits_equal_those_of_transformers(folder, mesh):
    expected = reference(folder)["logits"]
    logits = logits_of(loaded(folder, mesh), reference(folder)["input_ids"])
    difference = np.abs(logits - expected).max() / np.abs(expected).max()
    print(f"{folder.name} {mesh}: max |spmd - transformers| / max |logit| = {difference:.2e}")
    assert difference <= 1e-4
    assert np.ptp(expected) > 5  # logits span units: a wrong mapping could not pass


def test_each_fixture_is_the_model_it_names():
    cfg, tied = loaded(OLMO2, "dp=1").model, loaded(TIED, "dp=1").model
    assert type(cfg) is olmo2.Olmo2Config and family.of(cfg).name == "olmo2"
    assert not cfg.tie_embeddings and tied.tie_embeddings
    assert cfg.n_heads * cfg.head_dim != cfg.embed_dim and cfg.n_kv_heads < cfg.n_heads
    assert cfg.n_params() == sum(x.size for x in jax.tree.leaves(loaded(OLMO2, "dp=1").params))
    # the norm scales split with the heads: [layers, heads / tp, head_dim] on each device
    attn = loaded(OLMO2, "dp=2,fsdp=2,tp=2").params["blocks"]["attn"]
    assert attn["q_norm"]["scale"].addressable_shards[0].data.shape == (2, 2, 8)
    assert attn["k_norm"]["scale"].addressable_shards[0].data.shape == (2, 1, 8)


def test_the_q_and_k_norms_span_every_head():
    """HeadsRMSNorm is one RMS norm over heads x head_dim features (HF's flat q_norm, written
    out here in numpy), which a norm of each head alone is not."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 8)).astype(np.float32) * np.arange(1, 5)[:, None]
    scale = rng.standard_normal((4, 8)).astype(np.float32)
    with nnx.use_eager_sharding(False):  # no mesh: the params' logical names stay names
        norm = HeadsRMSNorm(4, 8, 1e-6, nnx.Rngs(0), "heads")
    norm.scale[...] = jnp.asarray(scale)
    flat_x = x.reshape(2, 3, 32)
    whole = flat_x / np.sqrt((flat_x**2).mean(-1, keepdims=True) + 1e-6)
    expected = whole.reshape(x.shape) * scale
    np.testing.assert_allclose(jax.jit(lambda v: norm(v))(x), expected, rtol=1e-5, atol=1e-5)
    each_head = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * scale
    assert np.abs(each_head - expected).max() > 0.1


def test_greedy_generation_equals_that_of_transformers():
    """The key/value-cache decoder through OLMo 2's blocks, on the 3-D mesh."""
    prompts = reference(OLMO2)["input_ids"].tolist()
    expected = reference(OLMO2)["greedy_ids"]
    source = loaded(OLMO2, "dp=2,fsdp=2,tp=2")
    assert generate.generate(source.program, source.params, prompts, expected.shape[1]) == (
        expected.tolist()
    )


def test_hf_to_spmd_to_hf_is_bit_exact_through_the_commands(tmp_path):
    original, source, written = convert_round_trip(OLMO2, tmp_path, "dp=2,fsdp=2,tp=2")
    assert len(original) == 25
    assert written["architectures"] == ["Olmo2ForCausalLM"] and written["model_type"] == "olmo2"
    assert "mlp_bias" not in written and written["rope_parameters"] == source["rope_parameters"]
    assert olmo2.config_from_hf(written, "back") == olmo2.config_from_hf(source, "source")


def test_a_tied_config_goes_to_config_json_and_back():
    cfg = loaded(TIED, "dp=1").model
    written = olmo2.FAMILY.hf.config_to_hf(cfg, "bfloat16", 4096)
    assert written["tie_word_embeddings"] and written["max_position_embeddings"] == 4096
    assert olmo2.config_from_hf(written, "written") == cfg
    defaults = {k: v for k, v in written.items() if k not in ("rms_norm_eps", "architectures")}
    assert olmo2.config_from_hf(defaults, "model_type only").norm_eps == 1e-5  # OLMo 2's


@functools.cache
def train_run(mesh: str, executor: str = "auto", steps: int = 3):
    """(losses, final params, the compiled step) of `steps` AdamW steps from the fixture's
    weights on `mesh`, all on one batch of random tokens (so the loss falls)."""
    cfg = family.open_hf(str(OLMO2)).config
    run = flat(None, steps=steps, batch=8, seq_len=16, warmup=1, lr=3e-3)
    program = build_program(
        lambda seed: olmo2.FAMILY.create(cfg, seed),
        llama.lm_loss,
        lambda names: optimizer(run)(names),
        trainer.layout(mesh),
        executor=executor,
    )
    step = program.compile_train_step(8, 16)
    params, opt_state, loss_scale = weights.init_from_hf(str(OLMO2), program)
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
    return np.asarray(jax.device_get(losses)), jax.device_get(params), step


@pytest.mark.parametrize(
    "mesh, executor",
    [
        ("dp=2,fsdp=2,tp=2", "auto"),
        ("dp=2,fsdp=2,tp=2", "explicit"),  # the norms' sums of squares: a psum over tensor
        # tp over the 2 kv heads: replicated, each device norms k over both (no psum) and
        # keeps its own; the q norm sums over 4 devices of one head each
        ("fsdp=2,tp=4", "explicit"),
    ],
)
def test_training_steps_on_a_sharded_mesh_equal_one_device(mesh, executor):
    losses, params, _ = train_run(mesh, executor)
    one_losses, one_params, _ = train_run("dp=1")
    print(f"{mesh} {executor}: losses {losses} vs one device {one_losses}")
    assert trainer.max_relative_difference(losses, one_losses) <= 1e-4
    assert losses[-1] < losses[0]  # the steps train
    # Adam's update of a near-zero gradient is about its sign: tests/test_parity.py's bound
    for (path, value), expected in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(one_params), strict=True
    ):
        np.testing.assert_allclose(value, expected, rtol=1e-3, atol=2e-5, err_msg=str(path))


def test_the_planner_agrees_with_the_engine_and_the_compiled_step():
    """Params + optimizer state per device (the q / k norm scales split with the heads) and
    the step's FLOPs on dp=2,fsdp=2,tp=2: the planner's figures against the engine's
    shardings and the dot instructions of the step the training test compiled."""
    cfg = loaded(OLMO2, "dp=1").model
    mesh = {**dict.fromkeys(MESH_AXES, 1), **parse_mesh("dp=2,fsdp=2,tp=2")}
    s = cost.Setup(shape=cfg.shape(), n_params=cfg.n_params(), mesh=mesh, zero=3,
                   precision="fp32", optimizer="adamw", batch=8, seq_len=16)  # fmt: skip
    program, _ = plan.engine_program(s, cfg, jax.devices()[:8])
    engine = sharded_bytes(program.abstract_params) + sharded_bytes(program.abstract_opt_state)
    state = memory.model_state_bytes(s)
    planned = state["params"] + state["optimizer"]
    dots = hlo_dot_flops(train_run("dp=2,fsdp=2,tp=2")[2]) * s.devices
    print(f"state bytes engine / planner {engine / planned:.4f}, compiled dot FLOPs / planner "
          f"{dots / timing.executed_flops(s):.4f}")  # fmt: skip
    assert engine == pytest.approx(planned, rel=1e-3)
    assert dots == pytest.approx(timing.executed_flops(s), rel=1e-2)


def test_training_starts_from_the_olmo2_weights_through_a_pipeline(tmp_path):
    """--init-from-hf with an OLMo 2 folder on pp=2 (its blocks are alike, so a stage may hold
    any of them): the run's model is the folder's and the first step's loss, taken before the
    update, is the one-device loss of that step's batch."""
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"  # bytes below 64: the fixture's vocab is 64
    corpus.write_text(
        " ".join("".join(rng.choice(list("0123456789+-*/=<>"), 5)) for _ in range(400))
    )
    metrics = tmp_path / "metrics.jsonl"
    args = ["--init-from-hf", str(OLMO2), "--data", str(corpus), "--mesh", "pp=2,dp=2"]
    args += ["--data-cache", str(tmp_path / "cache"), "--metrics", str(metrics)]
    args += ["--steps", "2", "--log-every", "1", "--batch", "8", "--seq-len", "16"]
    args += ["--eval-fraction", "0"]
    assert train.main(args) == 0
    records = cli.records(metrics)
    source = loaded(OLMO2, "dp=1")
    assert records[0]["config"]["model"] == dataclasses.asdict(source.model)
    windows = data.TokenWindows(
        tokens.open_tokens(str(corpus), cache_dir=str(tmp_path / "cache")).load(), 16, 0.0
    )
    ids = data.train_window_ids(0, 0, 8, windows.n_train)
    batch = data.global_batch(windows, ids, source.program.layout.batch_sharding())
    expected = float(source.program.eval_step(source.params, batch))
    first, second = [r for r in records if r["kind"] == "train"]
    assert (first["step"], second["step"]) == (1, 2)
    assert abs(first["loss"] - expected) <= 1e-5 * expected, (first["loss"], expected)


def edited(tmp_path: Path, **changes) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(OLMO2, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention_bias": True}, "attention_bias = True"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"sliding_window": 8}, "sliding_window = 8"),
        ({"head_dim": 4}, "q_proj.weight has shape (32, 16), but config.json implies (16, 16)"),
    ],
    ids=["attention-bias", "activation", "yarn", "sliding-window", "head-dim"],
)
def test_what_olmo2_does_not_compute_exits_2_naming_it(tmp_path, capsys, changes, named):
    args = ["--from-hf", edited(tmp_path, **changes), "--to", str(tmp_path / "out")]
    assert convert.main([*args, "--mesh", "fsdp=-1"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_llama_only_switches_are_refused_by_their_flags():
    cfg = loaded(OLMO2, "dp=1").model
    for change, flag in (
        ({"qk_norm": True}, "--qk-norm True"),
        ({"sliding_window": 4}, "--sliding-window 4"),
    ):
        with pytest.raises(UsageError, match=flag):
            olmo2.check(dataclasses.replace(cfg, **change))
    values = {**config.preset("tiny"), "family": "olmo2"}
    assert family.check_fields(values, "preset") is olmo2.Olmo2Config
