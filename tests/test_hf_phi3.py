"""Phi-3 (`Phi3ForCausalLM`) against transformers: a tiny checkpoint written by `transformers`
itself (tests/fixtures/make_hf_phi3.py, run once by hand; torch and transformers are not
needed here), whose q, k, v and gate, up weights are fused tensors and whose sliding window is
narrower than the rows, gives transformers' logits and greedy tokens on one device and on
dp=2,fsdp=2,tp=2; the fused tensors split into the right params on import and fuse back bit
for bit on export (through the commands, and sharded into several files); three AdamW steps
on dp=2,fsdp=2,tp=2 equal one device under both executors; the planner's state bytes and
FLOPs agree with the compiled step; what spmd does not compute exits 2 naming the field."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from models import family, hf_phi3, hf_tensors, phi3
from spmd import convert, generate, plan, train
from spmd.engine.state_layout import sharded_bytes
from spmd.engine.step import build_program
from spmd.errors import UsageError
from spmd.estimate import cost, memory, timing
from spmd.estimate.flops import hlo_dot_flops
from spmd.parallel.mesh import parse_mesh
from spmd.run import config, weights
from spmd.run.builder import optimizer
from spmd.run.config import flat
from tests import trainer
from tests.test_hf import convert_round_trip, logits_of
from tests.test_hf import hf_tensors as read_hf

PHI3 = Path(__file__).resolve().parent / "fixtures" / "hf_phi3"
MESHES = ("dp=1", "dp=2,fsdp=2,tp=2")
MESH_AXES = ("data", "pipeline", "fsdp", "expert", "context", "tensor")


@functools.cache
def reference() -> dict[str, np.ndarray]:
    return dict(np.load(PHI3 / "reference.npz"))


@functools.cache
def loaded(mesh: str) -> weights.Loaded:
    return weights.from_hf(str(PHI3), trainer.layout(mesh))


def logit_difference(source: weights.Loaded) -> float:
    """Max |spmd - transformers| over the fixture's logits, relative to their largest."""
    expected = reference()["logits"]
    logits = logits_of(source, reference()["input_ids"])
    return float(np.abs(logits - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("mesh", MESHES)
def test_logits_equal_those_of_transformers(mesh):
    difference = logit_difference(loaded(mesh))
    print(f"phi3 {mesh}: max |logit difference| / max |logit| = {difference:.2e}")
    assert difference <= 1e-4


def test_the_fixture_is_a_grouped_phi3_with_a_narrow_window():
    cfg = loaded("dp=1").model
    assert type(cfg) is phi3.Phi3Config and family.of(cfg).name == "phi3"
    assert cfg.n_kv_heads < cfg.n_heads and not cfg.tie_embeddings
    assert cfg.sliding_window == 5 < reference()["input_ids"].shape[1]
    assert cfg.norm_eps == 1e-5 and cfg.n_params() == sum(
        x.size for x in jax.tree.leaves(loaded("dp=1").params)
    )
    stored = read_hf(PHI3)
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored
    assert "model.layers.0.self_attn.q_proj.weight" not in stored
    assert np.ptp(reference()["logits"]) > 5  # a wrong mapping would move them by units


def test_the_window_matters():
    """Without its window the same weights miss transformers' logits by far."""
    source = loaded("dp=1")
    cfg = dataclasses.replace(source.model, sliding_window=0)
    program = weights.model_program(cfg, trainer.layout("dp=1"))
    other = weights.Loaded(cfg, program, source.params, {}, "no window")
    assert logit_difference(other) > 1e-2


def test_the_fused_tensors_split_at_heads_then_kv_heads_twice_and_gate_then_up():
    """Each layer's qkv_proj rows are q's (heads x head_dim), then k's and v's (kv_heads x
    head_dim each), and gate_up_proj's the gate's then up's, in the params as loaded sharded
    on dp=2,fsdp=2,tp=2 (each device holds its heads' and mlp columns' slices)."""
    cfg, params = loaded("dp=2,fsdp=2,tp=2").model, loaded("dp=2,fsdp=2,tp=2").params
    attn, mlp = params["blocks"]["attn"], params["blocks"]["mlp"]
    assert attn["wk"].addressable_shards[0].data.shape == (2, 8, 1, 4)  # layers, hid/fsdp, kv/tp
    stored = read_hf(PHI3)
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
    cfg = loaded("dp=1").model
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


def test_greedy_generation_equals_that_of_transformers():
    """The key/value-cache decoder (the window a mask over the full cache) on the 3-D mesh."""
    prompts = reference()["input_ids"].tolist()
    expected = reference()["greedy_ids"]
    source = loaded("dp=2,fsdp=2,tp=2")
    tokens = generate.generate(source.program, source.params, prompts, expected.shape[1])
    assert tokens == expected.tolist()


def test_hf_to_spmd_to_hf_is_bit_exact_through_the_commands(tmp_path):
    original, source, written = convert_round_trip(PHI3, tmp_path, "dp=2,fsdp=2,tp=2")
    assert len(original) == 15
    assert (written["architectures"], written["model_type"]) == (["Phi3ForCausalLM"], "phi3")
    assert written["rope_parameters"] == source["rope_parameters"]
    assert written["sliding_window"] == 5 and written["pad_token_id"] is None
    assert phi3.from_hf(written, "back") == phi3.from_hf(source, "source")


def test_spmd_params_to_a_sharded_hf_folder_and_back_are_bit_exact(tmp_path):
    """Random params on one mesh -> a Phi-3 folder in several safetensors files (a fused tensor
    whole in one of them) -> the same params on another mesh, bit for bit."""
    cfg = loaded("dp=1").model
    source = weights.model_program(cfg, trainer.layout("fsdp=2,tp=4"))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: jax.device_put(rng.standard_normal(x.shape, np.float32), x.sharding),
        source.abstract_params,
    )
    files = family.save_hf(params, cfg, str(tmp_path / "hf"), max_shard_bytes=4_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(files) > 4 and len(index["weight_map"]) == 15
    back = family.open_hf(str(tmp_path / "hf"))
    assert back.config == cfg
    target = weights.model_program(cfg, trainer.layout("dp=2,fsdp=2,tp=2"))
    again = family.load_hf(back, target.abstract_params)
    for (path, value), expected in zip(
        jax.tree_util.tree_flatten_with_path(again)[0], jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected), err_msg=str(path))


def train_run(mesh: str, executor: str = "auto", steps: int = 3):
    """(losses, final params) of `steps` AdamW steps from the fixture's weights on `mesh`,
    all on one batch of random tokens (so the loss falls)."""
    cfg = family.open_hf(str(PHI3)).config
    fam = family.of(cfg)
    run = flat(None, steps=steps, batch=8, seq_len=16, warmup=1, lr=3e-3)
    program = build_program(
        lambda seed: fam.create(cfg, seed),
        fam.loss,
        lambda names: optimizer(run)(names),
        trainer.layout(mesh),
        executor=executor,
    )
    params, opt_state, loss_scale = weights.init_from_hf(str(PHI3), program)
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 17), np.int32)
    sharding = program.layout.batch_sharding()
    batch = {
        "inputs": jax.device_put(rows[:, :-1], sharding),
        "targets": jax.device_put(rows[:, 1:], sharding),
    }
    losses = []
    for _ in range(steps):
        params, opt_state, loss_scale, metrics = program.train_step(
            params, opt_state, loss_scale, batch
        )
        losses.append(metrics["loss"])
    return np.asarray(jax.device_get(losses)), jax.device_get(params)


@functools.cache
def one_device_run():
    return train_run("dp=1")


@pytest.mark.parametrize("executor", ["auto", "explicit"])
def test_training_steps_on_a_sharded_mesh_equal_one_device(executor):
    losses, params = train_run("dp=2,fsdp=2,tp=2", executor)
    one_losses, one_params = one_device_run()
    difference = trainer.max_relative_difference(losses, one_losses)
    print(f"phi3 {executor}: losses {losses}, relative difference to one device {difference:.1e}")
    assert difference <= 1e-4
    assert losses[-1] < losses[0]  # the steps train
    # Adam's update of a near-zero gradient is about its sign: tests/test_parity.py's bound
    for (path, value), expected in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(one_params), strict=True
    ):
        np.testing.assert_allclose(value, expected, rtol=1e-3, atol=2e-5, err_msg=str(path))


def test_the_planner_agrees_with_the_compiled_step():
    """State bytes per device (params + AdamW state) of the planner vs the engine's shardings,
    and the planner's executed FLOPs vs the compiled step's dot FLOPs, on dp=2,fsdp=2,tp=2."""
    cfg = loaded("dp=1").model
    sizes = {**dict.fromkeys(MESH_AXES, 1), **parse_mesh("dp=2,fsdp=2,tp=2")}
    s = cost.Setup(shape=family.of(cfg).shape(cfg), n_params=cfg.n_params(), mesh=sizes, zero=3,
                   precision="fp32", optimizer="adamw", batch=8, seq_len=16, accum=1)  # fmt: skip
    cost.check_setup(s)
    program, _ = plan.engine_program(s, cfg, jax.devices()[:8])
    engine = sharded_bytes(program.abstract_params) + sharded_bytes(program.abstract_opt_state)
    state = memory.model_state_bytes(s)
    bytes_ratio = engine / (state["params"] + state["optimizer"])
    dots = hlo_dot_flops(program.compile_train_step(8, 16)) * s.devices
    flops_ratio = dots / timing.executed_flops(s)
    print(f"phi3 planner: state bytes engine/planner {bytes_ratio:.4f}, "
          f"FLOPs compiled/planner {flops_ratio:.4f}")  # fmt: skip
    assert bytes_ratio == pytest.approx(1, rel=1e-3)
    assert flops_ratio == pytest.approx(1, rel=0.01)


def test_training_from_the_phi3_folder_dry_runs(tmp_path, capsys):
    corpus = tmp_path / "digits.txt"  # bytes below 64: the fixture's vocab is 64
    corpus.write_text("0123456789 " * 200)
    args = ["--init-from-hf", str(PHI3), "--mesh", "dp=2,fsdp=2,tp=2", "--dry-run"]
    args += ["--data", str(corpus), "--data-cache", str(tmp_path / "cache")]
    args += ["--steps", "2", "--batch", "8", "--seq-len", "16"]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert 'family = "phi3"' in out and "sliding_window = 5" in out  # the run's [model]
    assert "compiled: dot instructions" in out  # it compiled the step and counted its FLOPs


def edited(tmp_path: Path, **changes) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(PHI3, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": None}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rope_parameters": LONGROPE}, "needs long_factor, a list of positive numbers"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
            "partial_rotary_factor = 0.75",
        ),
        ({"resid_pdrop": 0.1}, "resid_pdrop = 0.1"),
        ({"attention_dropout": 0.05}, "attention_dropout = 0.05"),
        ({"sliding_window": 0}, "sliding_window = 0 must be a positive integer"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"num_key_value_heads": 4}, "qkv_proj.weight has shape (32, 16), but config.json"),
    ],
    ids=[
        "longrope-incomplete",
        "llama3-rope",
        "partial-rotary",
        "resid-dropout",
        "attention-dropout",
        "window-0",
        "gelu",
        "kv-heads",
    ],  # fmt: skip
)
def test_what_spmd_does_not_compute_exits_2_naming_it(tmp_path, capsys, changes, named):
    args = ["--from-hf", edited(tmp_path, **changes), "--to", str(tmp_path / "out")]
    assert convert.main([*args, "--mesh", "fsdp=-1"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_llama_switches_a_phi3_lacks_are_refused_and_layers_pipeline():
    """qkv biases, q/k norms and rope scalings have no Phi-3 form; the layers are all alike,
    so a pipeline (pp=2) takes them, and the window refuses context parallelism."""
    cfg = loaded("dp=1").model
    for change, flag in (({"qk_norm": True}, "--qk-norm"), ({"rope_scaling": "linear"}, "linear")):
        with pytest.raises(UsageError, match=flag):
            phi3.check(dataclasses.replace(cfg, **change))
    phi3.check_layout(cfg, trainer.layout("pp=2,dp=4").mesh, "explicit")
    with pytest.raises(UsageError, match="with cp=2"):
        phi3.check_layout(cfg, trainer.layout("cp=2,dp=4").mesh, "auto")
    assert config.build(phi3.Phi3Config, dataclasses.asdict(cfg), "saved") == cfg


# --- LongRoPE (Phi-3.5-mini's rope) ----------------------------------------------------------

LONG = PHI3.parent / "hf_phi3_longrope"


@functools.cache
def long_loaded(mesh: str) -> weights.Loaded:
    return weights.from_hf(str(LONG), trainer.layout(mesh))


def relative_difference(source: weights.Loaded, ids: np.ndarray, expected: np.ndarray) -> float:
    logits = logits_of(source, ids)
    return float(np.abs(logits - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("mesh", MESHES)
def test_longrope_logits_equal_those_of_transformers_short_and_long(mesh):
    """16-token rows (past original_max_position_embeddings 8: the long factors) on both
    meshes, and their first 8 tokens alone (the short factors)."""
    ref = np.load(LONG / "reference.npz")
    source = long_loaded(mesh)
    long = relative_difference(source, ref["input_ids"], ref["logits"])
    short = relative_difference(source, ref["short_ids"][:, :8], ref["short_logits"])
    print(f"phi3 longrope {mesh}: relative logit difference long {long:.1e}, short {short:.1e}")
    assert long <= 1e-4 and short <= 1e-4


def test_longrope_fields_and_that_they_matter():
    cfg = long_loaded("dp=1").model
    assert (cfg.rope_scaling, cfg.rope_original_max_positions, cfg.rope_factor) == (
        "longrope",
        8,
        4.0,
    )
    assert (cfg.rope_short_factors, cfg.rope_long_factors) == ("1.1,1.7", "2.5,9.0")
    assert cfg.rope_attention_factor == pytest.approx((1 + np.log(4) / np.log(8)) ** 0.5)
    assert cfg.sliding_window == 0
    ref = np.load(LONG / "reference.npz")
    for change in ({"rope_attention_factor": 1.0}, {"rope_long_factors": "1.1,1.7"}):
        other_cfg = dataclasses.replace(cfg, **change)
        program = weights.model_program(other_cfg, trainer.layout("dp=1"))
        other = weights.Loaded(other_cfg, program, long_loaded("dp=1").params, {}, str(change))
        assert relative_difference(other, ref["input_ids"], ref["logits"]) > 1e-2, change


def test_longrope_greedy_generation_equals_that_of_transformers_and_a_crossing_is_refused():
    """Prompts past the original length decode with the long factors throughout, as
    transformers does; a prompt within it whose generation would pass it is refused (transformers
    recomputes its cache with the long factors there)."""
    ref = np.load(LONG / "reference.npz")
    source = long_loaded("dp=2,fsdp=2,tp=2")
    new = ref["greedy_ids"].shape[1]
    tokens = generate.generate(source.program, source.params, ref["input_ids"].tolist(), new)
    assert tokens == ref["greedy_ids"].tolist()
    short_prompts = ref["input_ids"][:, :4].tolist()
    generate.generate(source.program, source.params, short_prompts, 4)  # 8 positions: fine
    with pytest.raises(UsageError, match="generating past 8 positions"):
        generate.generate(source.program, source.params, short_prompts, 5)


def test_longrope_hf_to_spmd_to_hf_is_bit_exact_and_refuses_context_parallelism(tmp_path):
    _, source, written = convert_round_trip(LONG, tmp_path, "fsdp=2,tp=2", back_mesh="tp=2")
    assert phi3.from_hf(written, "back") == phi3.from_hf(source, "source")
    assert written["max_position_embeddings"] == 32 and written["sliding_window"] is None
    cfg = long_loaded("dp=1").model
    with pytest.raises(UsageError, match="longrope with cp=2"):
        phi3.check_layout(cfg, trainer.layout("cp=2,dp=4").mesh, "auto")
    with pytest.raises(UsageError, match="--rope-long-factors '2.5' must be 2 positive"):
        phi3.check(dataclasses.replace(cfg, rope_long_factors="2.5"))


def test_an_explicit_attention_factor_survives_the_export():
    """transformers reads rope_scaling before rope_parameters: an attention factor other than
    the one it would derive goes there too, and comes back."""
    cfg = dataclasses.replace(long_loaded("dp=1").model, rope_attention_factor=1.5)
    written = hf_phi3.hf_config(cfg, "float32", 64)
    assert written["rope_scaling"]["attention_factor"] == 1.5
    assert phi3.from_hf(written, "written") == cfg
    plain = hf_phi3.hf_config(long_loaded("dp=1").model, "float32", 64)
    assert sorted(plain["rope_scaling"]) == ["long_factor", "short_factor", "type"]
