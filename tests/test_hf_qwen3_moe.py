"""The qwen3_moe family against transformers: a tiny Qwen3MoeForCausalLM written by
`transformers` itself (tests/fixtures/make_hf_qwen3_moe.py, run once by hand; torch and
transformers are not needed here) gives transformers' logits on one device, on dp=2,fsdp=2,tp=2
and with the experts split over fsdp=2,ep=2 (and tp=2 inside each expert), for both settings
of norm_topk_prob; greedy tokens equal; HF -> spmd -> HF is bit-exact through the commands;
three AdamW steps sharded equal one device under both executors; the planner's state bytes and
FLOPs agree with the engine's and the compiled step's; dense layers between the sparse ones
and what else spmd does not compute exit 2 naming the field."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from models import family, hf_mixtral, hf_qwen3_moe, moe, qwen3_moe
from spmd import convert, generate, plan, train
from spmd.engine.state_layout import sharded_bytes
from spmd.engine.step import build_program
from spmd.errors import UsageError
from spmd.estimate import cost, memory, timing
from spmd.estimate.flops import hlo_dot_flops
from spmd.parallel.mesh import MESH_AXES
from spmd.run import weights
from spmd.run.builder import optimizer
from spmd.run.config import flat
from tests import trainer
from tests.test_hf import convert_round_trip, logits_of

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "hf_qwen3_moe"
MESHES = ("dp=1", "dp=2,fsdp=2,tp=2", "fsdp=2,ep=2,tp=2")
BATCH, SEQ_LEN = 8, 16  # the training steps'


@functools.cache
def reference() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURE / "reference.npz"))


@functools.cache
def loaded(mesh: str) -> weights.Loaded:
    return weights.from_hf(str(FIXTURE), trainer.layout(mesh))


def relative_difference(logits: np.ndarray, expected: np.ndarray) -> float:
    """Max |spmd - transformers|, relative to the largest logit."""
    return float(np.abs(logits - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("mesh", MESHES)
def test_logits_equal_those_of_transformers(mesh):
    source = loaded(mesh)
    difference = relative_difference(
        logits_of(source, reference()["input_ids"]), reference()["logits"]
    )
    print(f"{mesh}: max |spmd - transformers| / max |logit| = {difference:.2e}")
    assert difference <= 1e-4
    if "ep=2" in mesh:  # the 4 experts over fsdp x expert: one per device, tp splits its width
        w_gate = source.params["blocks"]["experts"]["w_gate"].addressable_shards[0].data
        assert w_gate.shape == (2, 1, 16, 12)  # layers, experts, embed, expert mlp / tp


def test_the_fixture_exercises_what_qwen3_moe_adds():
    """q/k norms, heads x head_dim != hidden, experts narrower than the dense MLP width, the
    top-k weights not renormalised, and routing that differs from token to token (every expert
    is some token's choice in every layer, tokens choose different pairs)."""
    cfg = loaded("dp=1").model
    assert type(cfg) is qwen3_moe.Qwen3MoEConfig and cfg.family == "qwen3_moe"
    assert cfg.qk_norm and cfg.n_heads * cfg.head_dim != cfg.embed_dim
    assert (cfg.n_experts, cfg.experts_per_token, cfg.capacity_factor) == (4, 2, 0.0)
    assert (cfg.expert_dim, cfg.mlp_dim) == (24, 40) and not cfg.norm_topk_prob
    assert cfg.z_loss_coef == 0 and cfg.aux_loss_coef == 0.001 and cfg.rope_theta == 1e6
    params = jax.tree.leaves(loaded("dp=1").params)
    assert sum(p.size for p in params) == cfg.n_params()  # exact count, the experts' included
    assert np.ptp(reference()["logits"]) > 5
    for layer in reference()["router_choices"]:  # [layers, tokens, k]
        assert set(layer.ravel()) == set(range(cfg.n_experts))
        assert len({tuple(sorted(pair)) for pair in layer}) >= 4


def test_norm_topk_prob_switches_the_routers_weights_as_transformers_does():
    """The same weights with norm_topk_prob true give transformers' logits for that setting,
    which are far from the fixture's own (the switch matters at 0.2 of the largest logit)."""
    source = loaded("dp=1")
    cfg = dataclasses.replace(source.model, norm_topk_prob=True)
    program = weights.model_program(cfg, trainer.layout("dp=1"))
    switched = weights.Loaded(cfg, program, source.params, {}, "normalized")
    logits = logits_of(switched, reference()["input_ids"])
    assert relative_difference(logits, reference()["logits_normalized"]) <= 1e-4
    assert relative_difference(logits, reference()["logits"]) > 1e-2


def test_greedy_generation_equals_that_of_transformers_with_experts_split():
    prompts = reference()["input_ids"].tolist()
    expected = reference()["greedy_ids"]
    source = loaded("fsdp=2,ep=2,tp=2")
    tokens = generate.generate(source.program, source.params, prompts, expected.shape[1])
    assert tokens == expected.tolist()


def test_hf_to_spmd_to_hf_is_bit_exact_through_the_commands(tmp_path):
    # one device: the sharded reads and writes of expert tensors are tests/test_hf_mixtral.py's
    original, source, written = convert_round_trip(FIXTURE, tmp_path, "dp=1")
    assert len(original) == 2 * (8 + 1 + 3 * 4) + 3
    for key in ("architectures", "model_type", "rope_parameters", "num_experts"):
        assert written[key] == source[key], key
    for key in ("moe_intermediate_size", "intermediate_size", "norm_topk_prob", "head_dim"):
        assert written[key] == source[key], key
    read = qwen3_moe.config_from_hf
    assert read(written, "back") == read(source, "source")


def test_transformers_5s_num_local_experts_spelling_reads_alike(tmp_path):
    raw = json.loads((FIXTURE / "config.json").read_text())
    raw["num_local_experts"] = raw.pop("num_experts")
    assert qwen3_moe.config_from_hf(raw, "t5") == loaded("dp=1").model


def train_run(mesh: str, executor: str = "auto", compiled: bool = False):
    """(losses, final params, the step's dot FLOPs per device or None) of 3 AdamW steps from
    the fixture's weights on `mesh`, all on one batch of random tokens (so the loss falls);
    `compiled`: through the AOT-compiled step, whose dots are counted."""
    cfg = family.open_hf(str(FIXTURE)).config
    fam = family.of(cfg)
    run = flat(None, steps=3, batch=BATCH, seq_len=SEQ_LEN, warmup=0, lr=3e-3)
    program = build_program(
        lambda seed: fam.create(cfg, seed),
        fam.loss,
        lambda names: optimizer(run)(names),
        trainer.layout(mesh),
        executor=executor,
    )
    step = program.compile_train_step(BATCH, SEQ_LEN) if compiled else program.train_step
    params, opt_state, loss_scale = weights.init_from_hf(str(FIXTURE), program)
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, SEQ_LEN + 1), np.int32)
    sharding = program.layout.batch_sharding()
    batch = {
        "inputs": jax.device_put(rows[:, :-1], sharding),
        "targets": jax.device_put(rows[:, 1:], sharding),
    }
    losses = []
    for _ in range(3):
        params, opt_state, loss_scale, metrics = step(params, opt_state, loss_scale, batch)
        losses.append(metrics["loss"])
    dots = hlo_dot_flops(step) if compiled else None
    return np.asarray(jax.device_get(losses)), jax.device_get(params), dots


@functools.cache
def one_device_run():
    return train_run("dp=1", compiled=True)


@pytest.mark.parametrize("executor", ["auto", "explicit"])
def test_training_steps_on_a_sharded_mesh_equal_one_device(executor):
    """The loss includes the load-balancing loss (router_aux_loss_coef), as the run's would."""
    losses, params, _ = train_run("dp=2,fsdp=2,tp=2", executor)
    one_losses, one_params, _ = one_device_run()
    difference = trainer.max_relative_difference(losses, one_losses)
    print(f"{executor}: losses {losses} vs one device, max relative difference {difference:.1e}")
    assert difference <= 1e-4
    assert losses[2] < losses[1] < losses[0]  # every step updates (no warm-up) and trains
    # Adam's update of a near-zero gradient is about its sign: tests/test_parity.py's bound
    for (path, value), expected in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(one_params), strict=True
    ):
        np.testing.assert_allclose(value, expected, rtol=1e-3, atol=2e-5, err_msg=str(path))


def setup(cfg: qwen3_moe.Qwen3MoEConfig, mesh: dict[str, int], zero: int) -> cost.Setup:
    return cost.Setup(shape=cfg.shape(), n_params=cfg.n_params(), zero=zero, precision="fp32",
                      mesh={**dict.fromkeys(MESH_AXES, 1), **mesh}, optimizer="adamw",
                      batch=BATCH, seq_len=SEQ_LEN)  # fmt: skip


def test_the_planner_agrees_with_the_engine_and_the_compiled_step():
    """Analytic params + optimizer state per device equal the engine's shardings' (experts
    over fsdp x expert, their width over tensor); the planner's executed FLOPs (active
    experts + the dropless routing's padding) equal the compiled step's dots."""
    cfg = loaded("dp=1").model
    for mesh, zero in (({"fsdp": 2, "expert": 2, "tensor": 2}, 3), ({"data": 2, "expert": 4}, 1)):
        s = setup(cfg, mesh, zero)
        program, _ = plan.engine_program(s, cfg, jax.devices()[:8])
        engine = sharded_bytes(program.abstract_params) + sharded_bytes(program.abstract_opt_state)
        state = memory.model_state_bytes(s)
        ratio = engine / (state["params"] + state["optimizer"])
        print(f"{mesh} zero {zero}: engine / planner state bytes per device = {ratio:.4f}")
        assert ratio == pytest.approx(1, rel=1e-3)
    dots = one_device_run()[2]
    ratio = dots / timing.executed_flops(setup(cfg, {}, 1))
    print(f"compiled dot FLOPs / planner's executed FLOPs = {ratio:.4f}")
    assert ratio == pytest.approx(1, rel=0.01)


def test_a_dry_run_from_the_checkpoint_compiles_and_reports(tmp_path, capsys):
    corpus = tmp_path / "digits.txt"  # bytes below 64: the fixture's vocab is 64
    corpus.write_text("0123456789+-*/ " * 200)
    args = ["--init-from-hf", str(FIXTURE), "--mesh", "dp=1", "--dry-run"]
    args += ["--data", str(corpus), "--data-cache", str(tmp_path / "cache")]
    args += ["--steps", "2", "--batch", str(BATCH), "--seq-len", str(SEQ_LEN)]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert '[model] family = "qwen3_moe"' in out  # the echo: what differs from the defaults
    assert train.resolve_sections(args)["model"].norm_topk_prob is False  # the run's [model]
    assert "compiled vs" in out and "(x1.000)" in out  # state bytes: compiled / ZeRO formula


def edited(tmp_path: Path, **changes) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers = [1]"),
        ({"num_experts": 0}, "num_experts = 0"),
        ({"use_sliding_window": True}, "use_sliding_window / layer_types"),
        ({"attention_bias": True}, "attention_bias = True"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob = 'yes'"),
        ({"moe_intermediate_size": 12}, "has shape (24, 16), but config.json implies (12, 16)"),
    ],
    ids=["sparse-step", "mlp-only", "no-experts", "window", "bias", "top-k", "norm", "width"],
)
def test_what_spmd_does_not_compute_exits_2_naming_it(tmp_path, capsys, changes, named):
    args = ["--from-hf", edited(tmp_path, **changes), "--to", str(tmp_path / "out")]
    assert convert.main([*args, "--mesh", "fsdp=-1"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_what_neither_architecture_expresses_is_refused_on_export():
    cfg = loaded("dp=1").model
    with pytest.raises(UsageError, match="qk_norm False"):
        hf_qwen3_moe.hf_config_of(dataclasses.replace(cfg, qk_norm=False), "float32", 64)
    mixtral = moe.MoEConfig(**(vars(cfg) | {"family": "moe", "qk_norm": False, "mlp_dim": 24}))
    with pytest.raises(UsageError, match="norm_topk_prob False"):  # Mixtral always renormalises
        hf_mixtral.mixtral_hf_config(mixtral, "float32", 64)


def test_a_pipeline_runs_the_identical_blocks_only_without_router_losses():
    cfg = loaded("dp=1").model
    pipeline = trainer.layout("pp=2").mesh
    with pytest.raises(UsageError, match="pp=2 cannot carry the MoE router losses"):
        family.of(cfg).check_layout(cfg, pipeline, "auto")
    family.of(cfg).check_layout(dataclasses.replace(cfg, aux_loss_coef=0.0), pipeline, "auto")
    with pytest.raises(UsageError, match="--n-experts 0"):
        qwen3_moe.check(dataclasses.replace(cfg, n_experts=0))


def test_the_planners_train_command_keeps_the_expert_flags(capsys):
    """spmd.plan --recommend writes the train command of a qwen3_moe model with its experts
    (the MoE shape flags go with every family whose config has them, not with "moe" only)."""
    args = ["--model", "moe-tiny", "--family", "qwen3_moe", "--n-experts", "8", "--batch", "8"]
    assert plan.main([*args, "--devices", "4", "--recommend", "--json"]) == 0
    command = json.loads(capsys.readouterr().out)["recommendation"]["train_command"]
    assert "--family qwen3_moe" in command and " --n-experts 8 " in command
    # the family's own defaults that the moe-tiny preset lacks go with it too
    assert "--norm-topk-prob false" in command and "--qk-norm true" in command


def test_the_registry_finds_the_family_by_architecture_model_type_and_saved_section():
    from flax import nnx

    assert family.for_hf({"architectures": ["Qwen3MoeForCausalLM"]}, "x") is qwen3_moe.FAMILY
    assert family.for_hf({"model_type": "qwen3_moe"}, "x") is qwen3_moe.FAMILY
    cfg = loaded("dp=1").model
    assert family.config_from_dict(dataclasses.asdict(cfg)) == cfg  # a checkpoint's section
    model = nnx.eval_shape(lambda: qwen3_moe.FAMILY.create(cfg, 0))
    assert isinstance(model, family.CausalLM) and hasattr(model.blocks, "decode")
