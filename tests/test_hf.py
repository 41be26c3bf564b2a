"""Hugging Face interop: tiny Llama checkpoints written by `transformers` itself
(tests/fixtures/make_hf_llama.py, run once by hand; torch and transformers are not needed here)
load into the spmd model with the logits transformers computed, on one device and on a 3-D
mesh; spmd -> HF -> spmd is bit-exact; loading holds about one tensor on the host; bad folders
exit 2 naming the problem."""

import dataclasses
import json
import shutil
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from models import family, hf_config
from spmd import convert, train
from spmd.errors import UsageError
from spmd.io import data, eos, params_io, safetensors_io, tokens
from spmd.parallel import traced_layout
from spmd.run import weights
from tests import cli, trainer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
UNTIED, TIED = FIXTURES / "hf_llama_untied", FIXTURES / "hf_llama_tied"


def logits_of(loaded: weights.Loaded, input_ids: np.ndarray) -> np.ndarray:
    layout = loaded.program.layout

    @jax.jit
    def forward(params, tokens):
        with traced_layout.activation_layout(layout.mesh, layout.zero_stage):
            return nnx.merge(loaded.program.graphdef, params)(tokens)

    return np.asarray(forward(loaded.params, jax.device_put(input_ids, layout.batch_sharding())))


@pytest.fixture(scope="module")
def one_device_untied() -> weights.Loaded:
    return weights.from_hf(str(UNTIED), trainer.layout("dp=1"))


@pytest.mark.parametrize("mesh", ["dp=1", "dp=2,fsdp=2,tp=2"])
@pytest.mark.parametrize("folder", [UNTIED, TIED], ids=["untied", "tied"])
def test_logits_equal_those_of_transformers(folder, mesh):
    reference = np.load(folder / "reference.npz")
    loaded = weights.from_hf(str(folder), trainer.layout(mesh))
    assert loaded.model.tie_embeddings == (folder == TIED)
    logits = logits_of(loaded, reference["input_ids"])
    np.testing.assert_allclose(logits, reference["logits"], rtol=0, atol=1e-4)
    # the weights are wide enough that a wrong mapping could not pass: logits span units
    assert np.ptp(reference["logits"]) > 5


def test_a_transformers_4_config_reads_like_a_transformers_5_one():
    new = json.loads((TIED / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "head_dim")}
    old.update(rope_theta=500000.0, rope_scaling=None)  # head_dim then follows hidden / heads
    assert new["head_dim"] != new["hidden_size"] // new["num_attention_heads"]
    from_new = hf_config.llama_config(new, "new")
    from_old = hf_config.llama_config(old, "old")
    assert from_new.rope_theta == from_old.rope_theta == 500000.0
    assert from_old == dataclasses.replace(from_new, head_dim=4)
    assert from_new.norm_eps == 1e-6 and from_new.tie_embeddings
    del old["architectures"]  # then model_type says it
    assert hf_config.llama_config(old, "old") == from_old
    with pytest.raises(UsageError, match="architecture model_type 'gpt2' is not supported"):
        hf_config.llama_config({**old, "model_type": "gpt2"}, "gpt2")


def test_spmd_to_hf_to_spmd_is_bit_exact_and_loads_one_tensor_at_a_time(tmp_path):
    cfg = trainer.tiny_config()
    source = weights.model_program(cfg, trainer.layout("fsdp=2,tp=4"))
    rng = np.random.default_rng(0)
    params = jax.tree.map(  # random values in the source layout (cheaper than compiling init)
        lambda x: jax.device_put(rng.standard_normal(x.shape, np.float32), x.sharding),
        source.abstract_params,
    )
    files = family.save_hf(params, cfg, str(tmp_path / "hf"), max_shard_bytes=200_000)
    assert len(files) > 3  # several shards, the index and config.json
    back = family.open_hf(str(tmp_path / "hf"))
    assert back.config == cfg
    target = weights.model_program(cfg, trainer.layout("dp=2,fsdp=2,tp=2"))
    loaded = family.load_hf(back, target.abstract_params)
    for path, value in jax.tree_util.tree_flatten_with_path(loaded)[0]:
        expected = np.asarray(jax.device_get(_at(params, path)))
        np.testing.assert_array_equal(np.asarray(value), expected, err_msg=str(path))
        assert value.sharding == _at(target.abstract_params, path).sharding
    # Host memory of a second load (the first one also compiled, which allocates Python
    # objects): numpy's buffers are traced; device buffers and memory maps are not.
    tracemalloc.start()
    jax.block_until_ready(family.load_hf(back, target.abstract_params))
    _, host_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    largest = max(t.dtype.itemsize * np.prod(t.shape) for t in back.tensors.values())
    stacked = 4 * cfg.n_layers * cfg.embed_dim * cfg.mlp_dim
    assert 4 * cfg.n_params() > 16 * largest and stacked >= 4 * largest
    # one tensor transformed on the host plus the device slices cut from it
    assert host_peak < 2 * largest, (host_peak, largest)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    found = {}
    for path in folder.glob("*.safetensors"):
        found.update({n: t.read() for n, t in safetensors_io.read_header(path)[0].items()})
    return found


def convert_round_trip(
    folder: Path, tmp_path: Path, mesh: str, back_mesh: str | None = None
) -> tuple[dict[str, np.ndarray], dict, dict]:
    """HF `folder` -> spmd checkpoint (on `mesh`) -> HF folder (on `back_mesh`, default the
    same) through the spmd.convert command; asserts every tensor comes back with its name,
    dtype and values bit for bit. Returns (the original tensors, its config.json, the written
    config.json) for the caller's own checks."""
    spmd_dir, hf_dir = str(tmp_path / "spmd"), str(tmp_path / "hf")
    assert convert.main(["--from-hf", str(folder), "--to", spmd_dir, "--mesh", mesh]) == 0
    back_args = ["--checkpoint", spmd_dir, "--to-hf", hf_dir, "--mesh", back_mesh or mesh]
    assert convert.main(back_args) == 0
    original, back = hf_tensors(folder), hf_tensors(Path(hf_dir))
    assert sorted(original) == sorted(back)
    for tensor, value in original.items():
        assert back[tensor].dtype == value.dtype
        np.testing.assert_array_equal(back[tensor], value, err_msg=tensor)
    source = json.loads((folder / "config.json").read_text())
    return original, source, json.loads(Path(hf_dir, "config.json").read_text())


def test_the_commands_convert_hf_to_spmd_and_back_bit_exactly(tmp_path, capsys):
    spmd_dir, hf_dir = str(tmp_path / "spmd"), str(tmp_path / "hf")
    mesh = ["--mesh", "dp=2,fsdp=2,tp=-1"]
    assert convert.main(["--from-hf", str(TIED), "--to", spmd_dir, *mesh]) == 0
    assert convert.main(["--checkpoint", spmd_dir, "--to-hf", hf_dir, *mesh]) == 0
    assert params_io.saved_config(spmd_dir, 0)[eos.KEY] == [2]  # spmd.generate stops there
    assert eos.declared(hf_dir) == [2]  # and the export declares it for transformers
    assert json.loads(Path(hf_dir, "generation_config.json").read_text())["eos_token_id"] == 2
    original, back = hf_tensors(TIED), hf_tensors(Path(hf_dir))
    assert sorted(original) == sorted(back)
    for name, value in original.items():
        assert back[name].dtype == value.dtype
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    original_config = json.loads((TIED / "config.json").read_text())
    assert hf_config.llama_config(json.loads(Path(hf_dir, "config.json").read_text()), "back") == (
        hf_config.llama_config(original_config, "original")
    )
    capsys.readouterr()
    # Converted weights are no run to continue: --resume says so and what to do instead.
    resume = ["--checkpoint-dir", spmd_dir, "--resume", "--model", "tiny", *mesh]
    assert train.main(resume) == 2
    error = capsys.readouterr().err
    assert "holds weights converted from" in error and "--init-from-hf" in error
    # Neither direction overwrites: both targets exist now.
    assert convert.main(["--from-hf", str(TIED), "--to", spmd_dir, *mesh]) == 2
    assert convert.main(["--checkpoint", spmd_dir, "--to-hf", hf_dir, *mesh]) == 2


def test_training_starts_from_the_hf_weights(tmp_path, one_device_untied):
    """--init-from-hf: the model is the folder's and the first step's loss is the HF model's
    loss on that step's batch (the loss is taken before the update)."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefgh "), 6)) for _ in range(50)]
    corpus = tmp_path / "corpus.txt"  # ASCII: the fixture's vocab is 128
    corpus.write_text(" ".join(rng.choice(words, 3000)))
    metrics = tmp_path / "metrics.jsonl"
    args = ["--init-from-hf", str(UNTIED), "--data", str(corpus), "--mesh", "dp=-1"]
    args += ["--data-cache", str(tmp_path / "cache"), "--metrics", str(metrics)]
    args += ["--steps", "1", "--batch", "8", "--seq-len", "16", "--eval-fraction", "0"]
    assert train.main(args) == 0
    records = cli.records(metrics)
    model = records[0]["config"]["model"]
    assert model == dataclasses.asdict(one_device_untied.model)
    windows = data.TokenWindows(
        tokens.open_tokens(str(corpus), cache_dir=str(tmp_path / "cache")).load(), 16, 0.0
    )
    ids = data.train_window_ids(0, 0, 8, windows.n_train)
    batch = data.global_batch(windows, ids, one_device_untied.program.layout.batch_sharding())
    expected = float(one_device_untied.program.eval_step(one_device_untied.params, batch))
    (first,) = [r for r in records if r["kind"] == "train"]
    assert abs(first["loss"] - expected) <= 1e-5 * expected, (first["loss"], expected)


def copy_fixture(tmp_path: Path, folder: Path = TIED) -> Path:
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    return copy


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def drop_tensor(folder: Path, name: str) -> None:
    path = folder / "model.safetensors"
    tensors, metadata = safetensors_io.read_header(path)
    keep = [(n, t.shape, t.dtype) for n, t in tensors.items() if n != name]
    data = {n: np.array(t.read()) for n, t in tensors.items()}
    safetensors_io.write(path, keep, data.__getitem__, metadata)


def convert_error(folder: Path, tmp_path: Path, capsys) -> str:
    args = ["--from-hf", str(folder), "--to", str(tmp_path / "out"), "--mesh", "fsdp=-1"]
    assert convert.main(args) == 2
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


def test_a_missing_tensor_exits_2_naming_it(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    drop_tensor(folder, "model.layers.1.mlp.up_proj.weight")
    assert "has no tensor model.layers.1.mlp.up_proj.weight" in convert_error(
        folder, tmp_path, capsys
    )


def test_a_wrong_shape_exits_2_naming_the_tensor_and_both_shapes(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    edit_config(folder, intermediate_size=48)
    message = convert_error(folder, tmp_path, capsys)
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape (32, 16)" in message
    assert "implies (48, 16)" in message


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope type 'yarn'"),
        ({"attention_bias": True}, "attention_bias = True"),
        # transformers builds the model its model_type names: the two must agree
        ({"model_type": "qwen3"}, "architectures names LlamaForCausalLM but model_type 'qwen3'"),
    ],
    ids=["architecture", "rope-scaling", "bias", "model-type-contradicts"],
)
def test_an_unsupported_architecture_exits_2_naming_it(tmp_path, capsys, changes, named):
    folder = copy_fixture(tmp_path)
    edit_config(folder, **changes)
    assert named in convert_error(folder, tmp_path, capsys)


def test_an_unexpected_tensor_is_named(tmp_path):
    folder = copy_fixture(tmp_path)
    edit_config(folder, num_hidden_layers=1)
    with pytest.raises(UsageError, match="holds tensor model.layers.1.input_layernorm.weight"):
        family.open_hf(str(folder))


def test_the_command_exits_2_without_a_traceback(tmp_path):
    folder = copy_fixture(tmp_path)
    edit_config(folder, architectures=["GPT2LMHeadModel"])
    result = cli.run("spmd.convert", "--from-hf", str(folder), "--to", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert "architecture GPT2LMHeadModel is not supported" in result.stderr
    assert "Traceback" not in result.stderr
