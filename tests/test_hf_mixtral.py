"""Hugging Face Mixtral interop: a tiny MixtralForCausalLM written by `transformers` itself
(tests/fixtures/make_hf_mixtral.py, run once by hand; torch and transformers are not needed
here) loads into the spmd MoE model with the logits transformers computed, on one device and
with the experts split over ep=2; spmd -> HF -> spmd is bit-exact through the commands;
--init-from-hf trains from it; what
the MoE model does not compute exits 2 naming the field."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from models import family, hf_mixtral, moe
from spmd import convert, generate, train
from spmd.errors import UsageError
from spmd.io import data, tokens
from spmd.run import config, weights
from tests import cli, trainer
from tests.test_hf import hf_tensors, logits_of

MIXTRAL = Path(__file__).resolve().parent / "fixtures" / "hf_mixtral"


@pytest.mark.parametrize("mesh", ["dp=1", "dp=2,ep=2"])
def test_logits_equal_those_of_transformers(mesh):
    reference = np.load(MIXTRAL / "reference.npz")
    loaded = weights.from_hf(str(MIXTRAL), trainer.layout(mesh))
    cfg = loaded.model
    assert (cfg.n_experts, cfg.experts_per_token, cfg.capacity_factor) == (4, 2, 0.0)
    assert not cfg.tie_embeddings and cfg.rope_theta == 1e6
    if "ep=2" in mesh:  # each device holds half of the experts
        w_gate = loaded.params["blocks"]["experts"]["w_gate"]
        assert w_gate.addressable_shards[0].data.shape[1] == cfg.n_experts // 2
    logits = logits_of(loaded, reference["input_ids"])
    difference = np.abs(logits - reference["logits"]).max()
    assert difference <= 1e-4, difference
    # A wrong mapping could not pass: logits span units and routing varies by token (every
    # expert is some token's choice in every layer, and tokens choose different pairs).
    assert np.ptp(reference["logits"]) > 5
    choices = reference["router_choices"]  # [layers, tokens, k]
    for layer in choices:
        assert set(layer.ravel()) == set(range(cfg.n_experts))
        assert len({tuple(sorted(pair)) for pair in layer}) >= 4


def test_spmd_to_hf_to_spmd_is_bit_exact_through_the_commands(tmp_path):
    spmd_dir, hf_dir = str(tmp_path / "spmd"), str(tmp_path / "hf")
    mesh = ["--mesh", "fsdp=2,ep=2,tp=2"]
    assert convert.main(["--from-hf", str(MIXTRAL), "--to", spmd_dir, *mesh]) == 0
    assert convert.main(["--checkpoint", spmd_dir, "--to-hf", hf_dir, *mesh]) == 0
    original, back = hf_tensors(MIXTRAL), hf_tensors(Path(hf_dir))
    assert sorted(original) == sorted(back) and len(original) == 41
    for name, value in original.items():
        assert back[name].dtype == value.dtype
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    written = json.loads(Path(hf_dir, "config.json").read_text())
    assert written["architectures"] == ["MixtralForCausalLM"]
    original_config = json.loads((MIXTRAL / "config.json").read_text())
    assert hf_mixtral.mixtral_config(written, "back") == hf_mixtral.mixtral_config(
        original_config, "original"
    )
    # and back into spmd on another mesh: every param equal to the first load's
    first = weights.from_hf(str(MIXTRAL), trainer.layout("dp=1"))
    again = weights.from_hf(hf_dir, trainer.layout("ep=2,tp=2"))
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(first.params)[0],
        jax.tree.leaves(again.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def edited(tmp_path: Path, **changes) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(MIXTRAL, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1"),
        ({"sliding_window": 4096}, "sliding_window = 4096"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
        (
            {"num_local_experts": 8},
            "gate.weight has shape (4, 16), but config.json implies (8, 16)",
        ),
    ],
    ids=["jitter", "sliding-window", "top-k", "experts"],
)
def test_what_the_moe_model_lacks_exits_2_naming_it(tmp_path, capsys, changes, named):
    args = ["--from-hf", edited(tmp_path, **changes), "--to", str(tmp_path / "out")]
    assert convert.main([*args, "--mesh", "fsdp=-1"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_shared_expert_has_no_mixtral_equivalent(tmp_path):
    cfg = family.open_hf(str(MIXTRAL)).config
    with pytest.raises(UsageError, match="shared_expert True"):
        hf_mixtral.mixtral_hf_config(
            type(cfg)(**{**cfg.__dict__, "shared_expert": True}), "float32", 64
        )


def test_training_starts_from_the_mixtral_weights(tmp_path):
    """--init-from-hf with a Mixtral folder: the run's model is the MoE config of its
    config.json and the first step's loss (taken before the update, router loss included) is
    the loaded model's loss on that step's batch."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("0123456789+-*/=<>"), 5)) for _ in range(40)]
    corpus = tmp_path / "corpus.txt"  # bytes below 64: the fixture's vocab is 64
    corpus.write_text(" ".join(rng.choice(words, 2000)))
    metrics = tmp_path / "metrics.jsonl"
    args = ["--init-from-hf", str(MIXTRAL), "--data", str(corpus), "--mesh", "dp=-1,ep=2"]
    args += ["--data-cache", str(tmp_path / "cache"), "--metrics", str(metrics)]
    args += ["--steps", "1", "--batch", "8", "--seq-len", "16", "--eval-fraction", "0"]
    assert train.main(args) == 0
    records = cli.records(metrics)
    loaded = weights.from_hf(str(MIXTRAL), trainer.layout("dp=4,ep=2"))
    assert records[0]["config"]["model"] == dataclasses.asdict(loaded.model)
    windows = data.TokenWindows(
        tokens.open_tokens(str(corpus), cache_dir=str(tmp_path / "cache")).load(), 16, 0.0
    )
    ids = data.train_window_ids(0, 0, 8, windows.n_train)
    batch = data.global_batch(windows, ids, loaded.program.layout.batch_sharding())
    expected = float(loaded.program.eval_step(loaded.params, batch))
    (first,) = [r for r in records if r["kind"] == "train"]
    assert abs(first["loss"] - expected) <= 1e-5 * expected, (first["loss"], expected)


def test_greedy_generation_equals_that_of_transformers_with_experts_split():
    """The key/value-cache decoder runs the MoE blocks (dropless, so a token's experts see it
    alone) and picks transformers' greedy tokens, with the experts split over ep=2."""
    reference = np.load(MIXTRAL / "reference.npz")
    loaded = weights.from_hf(str(MIXTRAL), trainer.layout("dp=2,ep=2"))
    prompts = reference["input_ids"].tolist()
    new = reference["greedy_ids"].shape[1]
    tokens = generate.generate(loaded.program, loaded.params, prompts, new)
    assert tokens == reference["greedy_ids"].tolist()


def test_spmd_moe_params_to_hf_and_back_are_bit_exact(tmp_path):
    """Random params of the moe-tiny preset (not a Mixtral made by transformers) on one mesh
    -> a sharded Mixtral folder -> the same params on another mesh, bit for bit."""
    cfg = dataclasses.replace(moe.MoEConfig(**config.preset("moe-tiny")), z_loss_coef=0.0)
    source = weights.model_program(cfg, trainer.layout("fsdp=2,ep=2,tp=2"))
    rng = np.random.default_rng(0)
    params = jax.tree.map(  # random values in the source layout (cheaper than compiling init)
        lambda x: jax.device_put(rng.standard_normal(x.shape, np.float32), x.sharding),
        source.abstract_params,
    )
    files = family.save_hf(params, cfg, str(tmp_path / "hf"), max_shard_bytes=100_000)
    assert len(files) > 3  # several shards, the index and config.json
    back = family.open_hf(str(tmp_path / "hf"))
    assert back.config == cfg  # z-loss 0: Mixtral has none, so a non-zero one does not survive
    target = weights.model_program(cfg, trainer.layout("dp=2,ep=4"))
    loaded = family.load_hf(back, target.abstract_params)
    for (path, value), expected in zip(
        jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected), err_msg=str(path))


def test_init_from_hf_keeps_the_router_knobs_given_as_flags():
    from spmd import train

    folder = str(MIXTRAL)
    given = train.resolve_sections(["--init-from-hf", folder, "--capacity-factor", "1.25"])
    assert given["model"].capacity_factor == 1.25 and given["model"].n_experts == 4
    default = train.resolve_sections(["--init-from-hf", folder])
    assert default["model"].capacity_factor == 0.0  # Mixtral is dropless
