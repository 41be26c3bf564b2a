"""Every registered family against transformers, one row per tiny Hugging Face fixture
(tests/fixtures/make_hf.py writes them; tests/hf_fixtures.py reads them): the fixture is the
family and model it names and keeps the family contract (registry pick, saved section,
CausalLM with a cached decoder, exact parameter counts); its logits are transformers' within
1e-4 of the largest on one device and sharded, and miss them by far without each feature it
exercises; greedy tokens equal transformers'; HF -> spmd -> HF is bit-exact through
spmd.convert; AdamW steps sharded equal one device's under both executors; the planner's state
bytes and FLOPs equal the engine's and the compiled step's; --init-from-hf trains from it and
--dry-run compiles from it; LoRA trains on it. (What spmd does not compute exits 2 naming it:
tests/test_conformance_refusals.py, a table of config.json edits per fixture.)

A new family adds its fixture (a row of make_hf.TINY) and a row here; its own quirks go in
tests/test_hf_<family>.py."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from models import family
from spmd import generate, plan, train
from spmd.estimate import cost, memory, shape, timing
from spmd.estimate.flops import hlo_dot_flops
from spmd.io import data, tokens
from spmd.observe.observer import model_metrics
from spmd.parallel.mesh import MESH_AXES, parse_mesh
from spmd.run import builder, weights
from spmd.run.config import flat
from tests import cli, trainer
from tests.hf_fixtures import (
    BATCH,
    FIXTURES,
    ONE,
    SEQ_LEN,
    THREE_D,
    assert_params_equal,
    convert_round_trip,
    digits_corpus,
    loaded,
    logit_difference,
    logits_of,
    reference,
    relative_difference,
    state_bytes,
    train_run,
)
from tests.hf_fixtures import STEPS as TRAIN_STEPS

ROPE_KEYS = ("architectures", "model_type", "rope_parameters")


@dataclasses.dataclass(frozen=True)
class Fixture:
    """A fixture folder and what the suite checks on it (None / (): that check is not run)."""

    name: str  # tests/fixtures/<name>
    family: str  # the registered family that reads it
    fields: dict = dataclasses.field(default_factory=dict)  # config values it must have
    meshes: tuple[str, ...] = (ONE, THREE_D)  # logits against transformers'
    # the logits within 1e-4 absolute too (Gemma 3's span +-30: 1.5e-4 absolute is fp32's)
    absolute: bool = True
    shards: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # (mesh, param path, shard shape)
    depends_on: tuple[dict, ...] = ()  # config changes that must miss the logits by far
    greedy: str | None = THREE_D  # the mesh the cached decoder runs on
    round_trip: tuple[str, str] | None = (THREE_D, THREE_D)  # to spmd on, back to HF on
    n_tensors: int | None = None  # the HF tensors of the round trip
    same_in_config: tuple[str, ...] = ROPE_KEYS  # config.json keys the export keeps
    absent_in_config: tuple[str, ...] = ()  # and keys it does not write
    reload: str | None = None  # the exported folder loads on this mesh to the same params
    training: tuple[tuple[str, str], ...] = ()  # (mesh, executor) against one device
    planner: tuple[tuple[str, int], ...] = ()  # (mesh, ZeRO stage) of state bytes checked
    flops: tuple[str, str] | None = None  # the training run whose dots the planner counts
    flops_tolerance: float = 0.01
    init_from_hf: str | None = None  # the mesh of a 2-step --init-from-hf run
    dry_run: str | None = None  # the mesh of an --init-from-hf --dry-run
    dry_run_echo: tuple[str, ...] = ()  # what the dry run prints besides the family


GEMMA_KEYS = (*ROPE_KEYS, "layer_types")
MOE_KEYS = (*ROPE_KEYS, "num_experts", "moe_intermediate_size", "intermediate_size")
EP = "fsdp=2,ep=2,tp=2"

# In the order of the family registry's contract fixtures: the first row of a family is the
# one its LoRA test trains on.
TABLE = (
    Fixture("hf_llama_untied", "llama", dict(tie_embeddings=False, vocab_size=128),
            greedy=None, round_trip=None, init_from_hf="dp=-1"),
    Fixture("hf_llama_tied", "llama",
            dict(tie_embeddings=True, head_dim=8, n_heads=4, embed_dim=16, rope_theta=5e5),
            greedy=None, round_trip=None),  # tests/test_hf.py round-trips it with eos
    Fixture("hf_llama3", "llama", dict(rope_scaling="llama3", tie_embeddings=True),
            depends_on=({"rope_scaling": "none"},), training=((THREE_D, "auto"),)),
    Fixture("hf_qwen2", "llama", dict(qkv_bias=True, qk_norm=False),
            shards=((THREE_D, "blocks/attn/bq", (2, 2, 4)),),  # layers, heads / tp, head_dim
            # tp=4 splits the 2 kv heads' biases: each is shared by two devices
            training=((THREE_D, "explicit"), ("fsdp=2,tp=4", "auto"))),
    Fixture("hf_qwen3", "llama", dict(qk_norm=True, n_heads=4, head_dim=16, embed_dim=16),
            training=((THREE_D, "auto"),)),
    Fixture("hf_mistral", "llama", dict(sliding_window=5),  # < the 16-token rows
            depends_on=({"sliding_window": 0},), training=((THREE_D, "explicit"),)),
    Fixture("hf_mixtral", "moe",
            dict(n_experts=4, experts_per_token=2, capacity_factor=0.0, tie_embeddings=False,
                 rope_theta=1e6),
            meshes=(ONE, "dp=2,ep=2"), shards=(("dp=2,ep=2", "blocks/experts/w_gate",
                                                (2, 2, 16, 24)),),
            greedy="dp=2,ep=2", round_trip=(EP, EP), n_tensors=41,
            same_in_config=("architectures", "model_type"), reload="ep=2,tp=2",
            init_from_hf="dp=-1,ep=2"),
    Fixture("hf_gemma2", "gemma2",
            dict(attn_softcap=5.0, final_softcap=3.0, sliding_window=4, global_every=2,
                 query_pre_attn_scalar=12.0, head_dim=8),
            depends_on=({"attn_softcap": 0.0}, {"final_softcap": 0.0},
                        {"global_every": 1},  # every layer global: no window anywhere
                        {"query_pre_attn_scalar": 8.0}),  # head_dim's scale
            same_in_config=GEMMA_KEYS, training=((THREE_D, "explicit"),),
            planner=((THREE_D, 3),), flops=(THREE_D, "explicit"), flops_tolerance=0.05),
    Fixture("hf_gemma3", "gemma3",
            dict(qk_norm=True, n_layers=7, global_every=6, sliding_window=5, attn_softcap=0.0,
                 rope_local_theta=1e4, rope_theta=1e6, rope_scaling="linear"), absolute=False,
            depends_on=({"rope_local_theta": 1e6}, {"rope_scaling": "none"}),
            same_in_config=GEMMA_KEYS, training=((THREE_D, "auto"),),
            planner=((THREE_D, 3),), flops=(THREE_D, "auto"), flops_tolerance=0.05,
            dry_run=THREE_D),
    Fixture("hf_qwen3_moe", "qwen3_moe",
            dict(qk_norm=True, n_heads=4, head_dim=8, embed_dim=16, n_experts=4,
                 experts_per_token=2, capacity_factor=0.0, expert_dim=24, mlp_dim=40,
                 norm_topk_prob=False, z_loss_coef=0.0, aux_loss_coef=0.001, rope_theta=1e6),
            meshes=(ONE, THREE_D, EP),
            # the 4 experts over fsdp x expert, one per device; tp splits its width
            shards=((EP, "blocks/experts/w_gate", (2, 1, 16, 12)),),
            greedy=EP, round_trip=(ONE, ONE), n_tensors=2 * (8 + 1 + 3 * 4) + 3,
            same_in_config=(*MOE_KEYS, "norm_topk_prob", "head_dim"),
            training=((THREE_D, "auto"), (THREE_D, "explicit")),
            planner=((EP, 3), ("dp=2,ep=4", 1)), flops=(ONE, "auto"),
            dry_run=ONE, dry_run_echo=("compiled vs", "(x1.000)")),
    Fixture("hf_glm4_moe", "glm4_moe",
            dict(n_layers=3, dense_layers="0", n_experts=4, expert_dim=24, mlp_dim=40,
                 partial_rotary_factor=0.5, qkv_bias=True, qk_norm=True, n_group=2,
                 topk_group=1, routed_scaling_factor=2.5, shared_expert=True,
                 shared_expert_mlp_dim=24, router_score="sigmoid", router_bias=True),
            meshes=(ONE, EP), depends_on=({"partial_rotary_factor": 1.0},
                                          {"routed_scaling_factor": 1.0}, {"n_group": 1}),
            shards=((EP, "blocks/experts/router_bias", (2, 4)),),  # layers, experts (whole)
            greedy=EP, round_trip=(ONE, EP), n_tensors=3 + 14 + 2 * 28,
            same_in_config=(*ROPE_KEYS, "n_routed_experts", "moe_intermediate_size",
                            "first_k_dense_replace", "n_shared_experts", "attention_bias"),
            training=((EP, "explicit"),), planner=((EP, 3),), flops=(ONE, "auto")),
    # layer groups: dense MLPs in layers 0, 1, 4, 5 (their own stack), experts in 2 and 3
    Fixture("hf_qwen3_moe_dense", "qwen3_moe",
            dict(n_layers=6, dense_layers="0-1,4-5", n_experts=4, mlp_dim=40, expert_dim=24),
            meshes=(ONE, EP), depends_on=({"dense_layers": "0-1,4"},),
            shards=((EP, "dense_blocks/mlp/w_gate", (4, 8, 20)),),
            greedy=EP, round_trip=(ONE, ONE), n_tensors=4 * 11 + 2 * 21 + 3,
            same_in_config=(*ROPE_KEYS, "moe_intermediate_size", "intermediate_size"),
            training=((EP, "explicit"),), planner=((EP, 3),), flops=(ONE, "auto")),
    Fixture("hf_olmo2", "olmo2",
            dict(tie_embeddings=False, n_heads=4, n_kv_heads=2, head_dim=8, embed_dim=16),
            # the norm scales split with the heads: [layers, heads / tp, head_dim]
            shards=((THREE_D, "blocks/attn/q_norm/scale", (2, 2, 8)),
                    (THREE_D, "blocks/attn/k_norm/scale", (2, 1, 8))),
            n_tensors=25, absent_in_config=("mlp_bias",),
            training=((THREE_D, "auto"),
                      (THREE_D, "explicit"),  # the norms' sums of squares: a psum over tensor
                      # tp over the 2 kv heads: replicated, each device norms k over both
                      ("fsdp=2,tp=4", "explicit")),
            planner=((THREE_D, 3),), flops=(THREE_D, "auto"),
            init_from_hf="pp=2,dp=2"),  # its blocks are alike: a stage may hold any of them
    Fixture("hf_olmo2_tied", "olmo2", dict(tie_embeddings=True), meshes=(ONE,), greedy=None,
            round_trip=None),
    Fixture("hf_phi3", "phi3",
            dict(n_heads=4, n_kv_heads=2, tie_embeddings=False, sliding_window=5,
                 norm_eps=1e-5),
            shards=((THREE_D, "blocks/attn/wk", (2, 8, 1, 4)),),  # layers, hid/fsdp, kv/tp, hd
            depends_on=({"sliding_window": 0},), n_tensors=15,
            same_in_config=(*ROPE_KEYS, "sliding_window", "pad_token_id"),
            training=((THREE_D, "auto"), (THREE_D, "explicit")),
            planner=((THREE_D, 3),), flops=(THREE_D, "auto"),
            dry_run=THREE_D, dry_run_echo=("sliding_window = 5", "compiled: dot instructions")),
    Fixture("hf_phi3_longrope", "phi3",
            dict(rope_scaling="longrope", rope_original_max_positions=8, rope_factor=4.0,
                 rope_short_factors="1.1,1.7", rope_long_factors="2.5,9.0", sliding_window=0),
            depends_on=({"rope_attention_factor": 1.0}, {"rope_long_factors": "1.1,1.7"}),
            round_trip=("fsdp=2,tp=2", "tp=2"),
            # the export adds the factors transformers derives to rope_parameters
            same_in_config=("architectures", "model_type", "max_position_embeddings",
                            "sliding_window")),
    Fixture("hf_gpt_oss", "gpt_oss",
            dict(n_experts=4, experts_per_token=2, expert_mlp_dim=24, head_dim=16, qkv_bias=True,
                 sliding_window=4, global_every=2, swiglu_limit=0.8, rope_scaling="yarn",
                 rope_factor=4.0, rope_truncate=False, norm_topk_prob=True),
            meshes=(ONE, THREE_D, EP, "ep=4,tp=2"),
            # the 4 experts over fsdp x expert, one per device; tp splits the 48 interleaved
            # gate / up columns into whole pairs
            shards=((EP, "blocks/experts/w_gate_up", (2, 1, 16, 24)),),
            depends_on=({"swiglu_limit": 7.0}, {"global_every": 1},
                        {"rope_attention_factor": 1.0}, {"rope_scaling": "none"}),
            greedy=EP, round_trip=(ONE, EP), n_tensors=2 * 17 + 3,
            same_in_config=(*GEMMA_KEYS, "sliding_window", "swiglu_limit", "swiglu_alpha"),
            training=((THREE_D, "auto"), (EP, "explicit")),
            planner=((EP, 3),), flops=(ONE, "auto"), dry_run=ONE),
)  # fmt: skip
CONTRACT = {row.family: row for row in reversed(TABLE)}  # each family's first row


def rows(*having: str) -> list:
    """pytest params of the rows whose fields `having` are set, with the rows' names."""
    chosen = [r for r in TABLE if all(getattr(r, field) for field in having)]
    return [pytest.param(r, id=r.name) for r in chosen]


def cases(field: str) -> list:
    """pytest params (row, item) of each item of each row's `field`."""
    return [
        pytest.param(r, item, id=f"{r.name}-{item}") for r in TABLE for item in getattr(r, field)
    ]


def test_every_registered_family_has_a_fixture():
    assert set(family.FAMILIES) == set(CONTRACT)


@pytest.mark.parametrize("row", rows())
def test_the_fixture_is_its_family_and_keeps_the_contract(row):
    """The registry picks the family from config.json; the config has the fields the fixture
    exercises, saves and restores as a checkpoint's [model] section and passes the family's
    check; `create` builds a CausalLM (the three pipeline pieces) whose blocks decode with a
    cache; n_params() and the estimators' shape count exactly the params it builds; the logits
    span units (a wrong mapping could not pass) and a MoE's routing varies by token."""
    checkpoint = family.open_hf(str(FIXTURES / row.name))  # headers only
    cfg, fam = checkpoint.config, family.get(row.family)
    assert checkpoint.family == row.family and family.of(cfg) is fam and cfg.family == row.family
    assert {k: getattr(cfg, k) for k in row.fields} == row.fields
    assert family.config_from_dict(dataclasses.asdict(cfg)) == cfg
    fam.check(cfg)
    model = nnx.eval_shape(lambda: fam.create(cfg, 0))
    assert isinstance(model, family.CausalLM) and hasattr(model.blocks, "decode")
    built = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(built))
    assert count == fam.n_params(cfg) == cfg.n_params() == shape.shape_params(fam.shape(cfg))
    assert np.ptp(reference(row.name)["logits"]) > 5
    for layer in reference(row.name).get("router_choices", ()):  # [layers, tokens, k]
        assert set(layer.ravel()) == set(range(cfg.n_experts))  # every expert some token's
        assert len({tuple(sorted(pair)) for pair in layer}) >= 4  # tokens choose apart


@pytest.mark.parametrize("row, mesh", cases("meshes"))
def test_logits_equal_those_of_transformers(row, mesh):
    expected = reference(row.name)["logits"]
    logits = logits_of(loaded(row.name, mesh), reference(row.name)["input_ids"])
    difference = relative_difference(logits, expected)
    print(f"{row.name} {mesh}: max |spmd - transformers| / max |logit| = {difference:.2e}")
    assert difference <= 1e-4
    if row.absolute:
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("row, shard", cases("shards"))
def test_params_split_over_the_mesh_as_the_layout_says(row, shard):
    mesh, path, expected = shard
    value = loaded(row.name, mesh).params
    for key in path.split("/"):
        value = value[key]
    assert value.addressable_shards[0].data.shape == expected


@pytest.mark.parametrize("row, change", cases("depends_on"))
def test_the_fixture_depends_on_what_it_exercises(row, change):
    """Without each feature (the same weights) the logits miss transformers' far beyond 1e-4."""
    assert logit_difference(row.name, ONE, **change) > 1e-2


@pytest.mark.parametrize("row", rows("greedy"))
def test_greedy_generation_equals_that_of_transformers(row):
    """The key/value-cache decoder (windows a mask over the full cache, a layer's window and
    rotary base by its index, experts split where the mesh splits them)."""
    prompts = reference(row.name)["input_ids"].tolist()
    expected = reference(row.name)["greedy_ids"]
    source = loaded(row.name, row.greedy)
    tokens = generate.generate(source.program, source.params, prompts, expected.shape[1])
    assert tokens == expected.tolist()


@pytest.mark.parametrize("row", rows("round_trip"))
def test_hf_to_spmd_to_hf_is_bit_exact_through_the_commands(row, tmp_path):
    folder = FIXTURES / row.name
    original, source, written = convert_round_trip(folder, tmp_path, *row.round_trip)
    if row.n_tensors is not None:
        assert len(original) == row.n_tensors
    for key in row.same_in_config:
        assert written[key] == source[key], key
    assert not set(row.absent_in_config) & set(written)
    read = family.for_hf(source, "source").hf.config_from_hf
    assert read(written, "back") == read(source, "source")
    if row.reload:  # and back into spmd on another mesh: every param equal to the first load's
        again = weights.from_hf(str(tmp_path / "hf"), trainer.layout(row.reload))
        assert_params_equal(again.params, loaded(row.name, ONE).params)


@pytest.mark.parametrize("row, run", cases("training"))
def test_training_steps_on_a_sharded_mesh_equal_one_device(row, run):
    """Three AdamW steps (the loss includes an MoE's load-balancing loss, as a run's would)."""
    sharded, one = train_run(row.name, *run), train_run(row.name, ONE)
    difference = trainer.max_relative_difference(sharded.losses, one.losses)
    print(f"{row.name} {run}: losses {sharded.losses}, relative to one device {difference:.1e}")
    assert difference <= 1e-4
    assert sharded.losses[2] < sharded.losses[1] < sharded.losses[0]  # every step trains
    # Adam's update of a near-zero gradient is about its sign: tests/test_parity.py's bound,
    # and a rare element whose sign flipped between the layouts' reduction orders
    flip = 2 * 3e-3 * TRAIN_STEPS  # train_run's lr
    for (path, value), expected in zip(
        jax.tree_util.tree_flatten_with_path(sharded.params)[0],
        jax.tree.leaves(one.params),
        strict=True,
    ):
        trainer.assert_close_but_sign_flips(value, expected, flip, 1e-3, 2e-5, str(path))


def setup(cfg, mesh: str, zero: int) -> cost.Setup:
    """The planner's view of the training runs (fp32 AdamW, BATCH x SEQ_LEN) on `mesh`."""
    sizes = {**dict.fromkeys(MESH_AXES, 1), **parse_mesh(mesh)}
    fam = family.of(cfg)
    s = cost.Setup(shape=fam.shape(cfg), n_params=fam.n_params(cfg), mesh=sizes, zero=zero,
                   precision="fp32", optimizer="adamw", batch=BATCH, seq_len=SEQ_LEN)  # fmt: skip
    cost.check_setup(s)
    return s


@pytest.mark.parametrize("row", rows("planner"))
def test_the_planner_agrees_with_the_engine_and_the_compiled_step(row):
    """Params + optimizer state per device: the planner's formula against the shardings of the
    engine's program (`plan.engine_program`, as --measure builds it), and on a mesh the
    training test ran, against that program's; the planner's executed FLOPs against the dot
    instructions of a training test's compiled step."""
    cfg = loaded(row.name, ONE).model
    trained = {mesh: train_run(row.name, mesh, executor) for mesh, executor in row.training}
    for mesh, zero in row.planner:
        s = setup(cfg, mesh, zero)
        program, _ = plan.engine_program(s, cfg, jax.devices()[:8])
        engine = state_bytes(program)
        if mesh in trained and zero == 3:
            assert engine == trained[mesh].state_bytes
        state = memory.model_state_bytes(s)
        ratio = engine / (state["params"] + state["optimizer"])
        print(f"{row.name} {mesh} ZeRO {zero}: state bytes engine / planner {ratio:.4f}")
        assert ratio == pytest.approx(1, rel=1e-3)
    mesh, executor = row.flops
    s = setup(cfg, mesh, 3)
    dots = hlo_dot_flops(train_run(row.name, mesh, executor).step) * s.devices
    ratio = dots / timing.executed_flops(s)
    print(f"{row.name} {mesh}: compiled dot FLOPs / planner's executed FLOPs {ratio:.4f}")
    assert ratio == pytest.approx(1, rel=row.flops_tolerance)


@pytest.mark.parametrize("row", rows("init_from_hf"))
def test_training_starts_from_the_hf_weights(row, tmp_path):
    """--init-from-hf: the run's model is the folder's, and the first step's loss (taken before
    the update, an MoE's router loss included) is the loaded model's loss on that batch."""
    corpus, metrics = digits_corpus(tmp_path), tmp_path / "metrics.jsonl"
    args = ["--init-from-hf", str(FIXTURES / row.name), "--mesh", row.init_from_hf]
    args += ["--data", str(corpus), "--data-cache", str(tmp_path / "cache")]
    args += ["--metrics", str(metrics), "--steps", "2", "--log-every", "1"]
    args += ["--batch", str(BATCH), "--seq-len", str(SEQ_LEN), "--eval-fraction", "0"]
    assert train.main(args) == 0
    records = cli.records(metrics)
    source = loaded(row.name, ONE)
    assert records[0]["config"]["model"] == dataclasses.asdict(source.model)
    windows = data.TokenWindows(
        tokens.open_tokens(str(corpus), cache_dir=str(tmp_path / "cache")).load(), SEQ_LEN, 0.0
    )
    ids = data.train_window_ids(0, 0, BATCH, windows.n_train)
    batch = data.global_batch(windows, ids, source.program.layout.batch_sharding())
    expected = float(source.program.eval_step(source.params, batch))
    first, second = [r for r in records if r["kind"] == "train"]
    assert (first["step"], second["step"]) == (1, 2)
    assert abs(first["loss"] - expected) <= 1e-5 * expected, (first["loss"], expected)


@pytest.mark.parametrize("row", rows("dry_run"))
def test_a_dry_run_from_the_folder_compiles(row, tmp_path, capsys):
    """`spmd.train --init-from-hf <folder> --dry-run`: the run's [model] names the family and
    the step compiles (its FLOPs and memory printed)."""
    args = ["--init-from-hf", str(FIXTURES / row.name), "--mesh", row.dry_run, "--dry-run"]
    args += ["--data", str(digits_corpus(tmp_path)), "--data-cache", str(tmp_path / "cache")]
    args += ["--steps", "2", "--batch", str(BATCH), "--seq-len", str(SEQ_LEN)]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    for echo in (f'family = "{row.family}"', *row.dry_run_echo):
        assert echo in out, echo


@pytest.mark.parametrize("name", sorted(family.FAMILIES))
def test_every_family_trains_lora_adapters_and_logs_its_metrics(name):
    """LoRA on each registered family (its first fixture's config, random weights, one
    device), through the run's own model (spmd.run.builder.run_model, as spmd.train and spmd.bench
    take it): two steps train the adapters and leave the base as it was, and the family's
    logged metrics (an MoE's router statistics) run on the LoRA model."""
    cfg = family.open_hf(str(FIXTURES / CONTRACT[name].name)).config
    run = flat(cfg, lora_rank=2, steps=2, batch=2, seq_len=16, lr=1e-2, warmup=0)
    program = builder.program(run, trainer.layout(ONE).mesh)
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 17), dtype=np.int32)
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    state = program.init()
    before = jax.device_get(state.params)
    state, first = program.step(state, batch)  # the state is donated
    state, second = program.step(state, batch)
    assert np.isfinite(first["loss"]) and second["loss"] < first["loss"]
    after = jax.device_get(state.params)
    frozen, trained = (
        [np.array_equal(o, n) for o, n in zip(*map(jax.tree.leaves, parts), strict=True)]
        for parts in ((before["frozen"], after["frozen"]), (before["lora"], after["lora"]))
    )
    assert all(frozen) and not all(trained)  # the base as it was, the adapters moved
    metrics = builder.run_model(run).metrics
    assert (metrics is not None) == bool(family.get(name).shape(cfg).n_experts)
    if metrics is not None:  # the MoE families: the router's statistics of the adapted model
        figures = jax.device_get(model_metrics(program, metrics)(state.params, batch))
        assert set(figures) >= {"aux_loss", "expert_load_max_over_mean"}
        assert all(np.isfinite(v).all() for v in figures.values())  # the per-layer lists too
