"""The Llama variants against transformers: tiny checkpoints written by `transformers` itself
(tests/fixtures/make_hf_families.py, run once by hand; torch and transformers are not needed
here) of Llama 3 rope scaling, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, head_dim !=
hidden / heads) and Mistral (a sliding window shorter than the sequence) give transformers'
logits and greedy tokens on one device and on dp=2,fsdp=2,tp=2, convert HF -> spmd -> HF bit
for bit, and train alike on one device and sharded, under both executors. What none of
transformers' architectures has, or spmd does not compute, exits 2 naming it."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, family, hf_config, llama
from models.rope import Rope
from spmd import convert, generate, train
from spmd.engine.step import build_program
from spmd.errors import UsageError
from spmd.run import weights
from spmd.run.builder import optimizer
from spmd.run.config import flat
from tests import trainer
from tests.test_hf import hf_tensors, logits_of

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = ("hf_llama3", "hf_qwen2", "hf_qwen3", "hf_mistral")
MESHES = ("dp=1", "dp=2,fsdp=2,tp=2")


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "reference.npz"))


@functools.cache
def loaded(name: str, mesh: str) -> weights.Loaded:
    return weights.from_hf(str(FIXTURES / name), trainer.layout(mesh))


def logit_difference(name: str, mesh: str) -> float:
    """Max |spmd - transformers| over the fixture's logits, relative to their largest."""
    expected = reference(name)["logits"]
    logits = logits_of(loaded(name, mesh), reference(name)["input_ids"])
    return float(np.abs(logits - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_equal_those_of_transformers(name, mesh):
    assert logit_difference(name, mesh) <= 1e-4


def test_each_fixture_is_the_variant_it_names():
    cfgs = {name: loaded(name, "dp=1").model for name in FAMILIES}
    assert cfgs["hf_llama3"].rope_scaling == "llama3" and cfgs["hf_llama3"].tie_embeddings
    assert cfgs["hf_qwen2"].qkv_bias and not cfgs["hf_qwen2"].qk_norm
    qwen3 = cfgs["hf_qwen3"]
    assert qwen3.qk_norm and qwen3.n_heads * qwen3.head_dim != qwen3.embed_dim
    assert cfgs["hf_mistral"].sliding_window == 5 < reference("hf_mistral")["input_ids"].shape[1]
    params = loaded("hf_qwen2", "dp=2,fsdp=2,tp=2").params["blocks"]["attn"]
    assert params["bq"].addressable_shards[0].data.shape == (2, 2, 4)  # layers, heads / tp, hd


@pytest.mark.parametrize(
    "name, change",
    [("hf_llama3", {"rope_scaling": "none"}), ("hf_mistral", {"sliding_window": 0})],
    ids=["llama3-rope", "sliding-window"],
)
def test_the_fixtures_depend_on_what_they_test(name, change):
    """Without its rope scaling or window the same weights miss transformers' logits by far:
    the fixtures exercise them (positions up to 15, a window of 5)."""
    source = loaded(name, "dp=1")
    cfg = dataclasses.replace(source.model, **change)
    program = weights.model_program(cfg, trainer.layout("dp=1"))
    other = weights.Loaded(cfg, program, source.params, {}, name)
    logits = logits_of(other, reference(name)["input_ids"])
    assert np.abs(logits - reference(name)["logits"]).max() > 1e-2


def test_llama3_inverse_frequencies_equal_those_of_transformers_in_every_band():
    cfg = loaded("hf_llama3", "dp=1").model
    expected = reference("hf_llama3")["inv_freq"]
    np.testing.assert_allclose(Rope.of(cfg).inv_freq(cfg.head_dim), expected, rtol=1e-6)
    half = cfg.head_dim // 2
    wavelength = 2 * np.pi * cfg.rope_theta ** (np.arange(half) / half)
    context = cfg.rope_original_max_positions
    kept = wavelength < context / cfg.rope_high_freq_factor
    scaled = wavelength > context / cfg.rope_low_freq_factor
    assert kept.sum() and scaled.sum() and (~kept & ~scaled).sum()  # all three bands occur
    plain = cfg.rope_theta ** (-np.arange(half) / half)
    np.testing.assert_allclose(expected[kept], plain[kept], rtol=1e-6)
    np.testing.assert_allclose(expected[scaled], plain[scaled] / cfg.rope_factor, rtol=1e-6)
    blended = ~kept & ~scaled
    assert np.all(expected[blended] < plain[blended])
    assert np.all(expected[blended] > plain[blended] / cfg.rope_factor)


def test_the_window_kernels_agree_with_the_band_written_out():
    """XLA's attention (jax's local window), the fp16 path's written-out kernel and a brute-force
    mask agree, with and without packed documents: key j is seen from query i when
    i - window < j <= i (and j is in i's document)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, s, 8)), jnp.float32) for s in (4, 2, 2))
    segments = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [5, 4, 3], axis=1))
    for docs in (None, segments):
        fused = attention.causal_attention(q, k, v, docs, window=3)
        written = attention.grouped_causal_attention(q, k, v, docs, window=3)
        i, j = np.arange(12)[:, None], np.arange(12)[None, :]
        band = jnp.asarray((j <= i) & (j > i - 3))[None]
        if docs is not None:
            band = band & attention.same_document(docs)
        logits = jnp.einsum("btkgd,bskd->bkgts", q.reshape(2, 12, 2, 2, 8), k) * 8**-0.5
        logits = jnp.where(band[:, None, None], logits, -jnp.inf)
        brute = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(logits, -1), v).reshape(q.shape)
        np.testing.assert_allclose(fused, brute, rtol=0, atol=1e-5)
        np.testing.assert_allclose(written, brute, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generation_equals_that_of_transformers(name):
    """The key/value-cache decoder (the window a mask over the full cache) on the 3-D mesh."""
    prompts = reference(name)["input_ids"].tolist()
    expected = reference(name)["greedy_ids"]
    source = loaded(name, "dp=2,fsdp=2,tp=2")
    tokens = generate.generate(source.program, source.params, prompts, expected.shape[1])
    assert tokens == expected.tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_to_spmd_to_hf_is_bit_exact_through_the_commands(name, tmp_path):
    folder = FIXTURES / name
    spmd_dir, hf_dir = str(tmp_path / "spmd"), str(tmp_path / "hf")
    mesh = ["--mesh", "dp=2,fsdp=2,tp=2"]
    assert convert.main(["--from-hf", str(folder), "--to", spmd_dir, *mesh]) == 0
    assert convert.main(["--checkpoint", spmd_dir, "--to-hf", hf_dir, *mesh]) == 0
    original, back = hf_tensors(folder), hf_tensors(Path(hf_dir))
    assert sorted(original) == sorted(back)
    for tensor, value in original.items():
        assert back[tensor].dtype == value.dtype
        np.testing.assert_array_equal(back[tensor], value, err_msg=tensor)
    source = json.loads((folder / "config.json").read_text())
    written = json.loads(Path(hf_dir, "config.json").read_text())
    assert written["architectures"] == source["architectures"]
    assert written["model_type"] == source["model_type"]
    assert written["rope_parameters"] == source["rope_parameters"]
    assert hf_config.llama_config(written, "back") == hf_config.llama_config(source, "source")


def train_run(name: str, mesh: str, executor: str = "auto", steps: int = 3):
    """(losses, final params) of `steps` AdamW steps from the fixture's weights on `mesh`,
    all on one batch of random tokens (so the loss falls)."""
    folder = str(FIXTURES / name)
    cfg = family.open_hf(folder).config
    run = flat(None, steps=steps, batch=8, seq_len=16, warmup=1, lr=3e-3)
    program = build_program(
        lambda seed: llama.create(cfg, seed),
        llama.lm_loss,
        lambda names: optimizer(run)(names),
        trainer.layout(mesh),
        executor=executor,
    )
    params, opt_state, loss_scale = weights.init_from_hf(folder, program)
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
def one_device_run(name: str):
    return train_run(name, "dp=1")


@pytest.mark.parametrize(
    "name, mesh, executor",
    [
        # one executor per family on the 3-D mesh (each executor sees biases, norms, a window
        # and the llama3 rope between them): the suite's time is tight
        ("hf_llama3", "dp=2,fsdp=2,tp=2", "auto"),
        ("hf_qwen3", "dp=2,fsdp=2,tp=2", "auto"),
        ("hf_qwen2", "dp=2,fsdp=2,tp=2", "explicit"),
        ("hf_mistral", "dp=2,fsdp=2,tp=2", "explicit"),
        ("hf_qwen2", "fsdp=2,tp=4", "auto"),  # tp over kv heads: biases of a shared kv head
    ],
)
def test_training_steps_on_a_sharded_mesh_equal_one_device(name, mesh, executor):
    losses, params = train_run(name, mesh, executor)
    one_losses, one_params = one_device_run(name)
    assert trainer.max_relative_difference(losses, one_losses) <= 1e-4
    assert losses[-1] < losses[0]  # the steps train
    # Adam's update of a near-zero gradient is about its sign: tests/test_parity.py's bound
    for (path, value), expected in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(one_params), strict=True
    ):
        np.testing.assert_allclose(value, expected, rtol=1e-3, atol=2e-5, err_msg=str(path))


def edited(tmp_path: Path, name: str, **changes) -> str:
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    "name, changes, named",
    [
        ("hf_qwen2", {"use_sliding_window": True}, "use_sliding_window / layer_types"),
        ("hf_qwen3", {"attention_bias": True}, "attention_bias = True"),
        ("hf_llama3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ("hf_llama3", {"rope_parameters": {"rope_type": "llama3", "factor": 8}}, "low_freq_factor"),
        ("hf_mistral", {"sliding_window": 0}, "sliding_window = 0 must be a positive integer"),
    ],
    ids=["qwen-sliding", "qwen3-output-bias", "dynamic-rope", "llama3-incomplete", "window-0"],
)
def test_what_spmd_does_not_compute_exits_2_naming_it(tmp_path, capsys, name, changes, named):
    args = ["--from-hf", edited(tmp_path, name, **changes), "--to", str(tmp_path / "out")]
    assert convert.main([*args, "--mesh", "fsdp=-1"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_sliding_window_with_context_parallelism_exits_2(tmp_path, capsys):
    """Ring attention masks causally only: a window with cp > 1 is refused before training."""
    corpus = tmp_path / "digits.txt"  # bytes below 64: the fixture's vocab is 64
    corpus.write_text("0123456789 " * 200)
    args = ["--init-from-hf", str(FIXTURES / "hf_mistral"), "--mesh", "dp=4,cp=2"]
    args += ["--data", str(corpus), "--data-cache", str(tmp_path / "cache")]
    args += ["--steps", "1", "--batch", "8", "--seq-len", "16"]
    assert train.main(args) == 2
    assert "--sliding-window 5 with cp=2" in capsys.readouterr().err


def test_a_model_no_architecture_has_is_refused_on_export():
    cfg = dataclasses.replace(loaded("hf_qwen3", "dp=1").model, qkv_bias=True)
    with pytest.raises(UsageError, match="has no Hugging Face architecture"):
        hf_config.hf_config(cfg, "float32", 64)
    assert hf_config.hf_architecture(dataclasses.replace(cfg, qk_norm=False)) == (
        "Qwen2ForCausalLM"
    )
