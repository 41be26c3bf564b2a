"""Hugging Face interop, what only the Llama checkpoints show (tests/test_conformance.py runs
every family's common checks, these fixtures' logits included): a transformers 4 config.json
reads like a transformers 5 one; spmd -> HF -> spmd is bit-exact and loading holds about one
tensor on the host; the commands convert both ways with the end-of-sequence token and refuse
to overwrite or resume converted weights; a missing or unexpected tensor is named, and the
command exits 2 without a traceback."""

import dataclasses
import json
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest

from models import family, hf_config
from spmd import convert, train
from spmd.errors import UsageError
from spmd.io import eos, params_io, safetensors_io
from spmd.run import weights
from tests import cli, trainer
from tests.hf_fixtures import (
    FIXTURES,
    convert_error,
    convert_round_trip,
    edited,
    save_random_params,
)

TIED = FIXTURES / "hf_llama_tied"


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
    params, files = save_random_params(cfg, "fsdp=2,tp=4", tmp_path / "hf", 200_000)
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


def test_the_commands_convert_hf_to_spmd_and_back_with_the_end_of_sequence_token(tmp_path, capsys):
    mesh = ["--mesh", "dp=2,fsdp=2,tp=-1"]
    _, source, written = convert_round_trip(TIED, tmp_path, mesh[1])
    spmd_dir, hf_dir = str(tmp_path / "spmd"), str(tmp_path / "hf")
    assert params_io.saved_config(spmd_dir, 0)[eos.KEY] == [2]  # spmd.generate stops there
    assert eos.declared(hf_dir) == [2]  # and the export declares it for transformers
    assert json.loads(Path(hf_dir, "generation_config.json").read_text())["eos_token_id"] == 2
    assert hf_config.llama_config(written, "back") == hf_config.llama_config(source, "source")
    capsys.readouterr()
    # Converted weights are no run to continue: --resume says so and what to do instead.
    resume = ["--checkpoint-dir", spmd_dir, "--resume", "--model", "tiny", *mesh]
    assert train.main(resume) == 2
    error = capsys.readouterr().err
    assert "holds weights converted from" in error and "--init-from-hf" in error
    # Neither direction overwrites: both targets exist now.
    assert convert.main(["--from-hf", str(TIED), "--to", spmd_dir, *mesh]) == 2
    assert convert.main(["--checkpoint", spmd_dir, "--to-hf", hf_dir, *mesh]) == 2


def drop_tensor(folder: Path, name: str) -> None:
    path = folder / "model.safetensors"
    tensors, metadata = safetensors_io.read_header(path)
    keep = [(n, t.shape, t.dtype) for n, t in tensors.items() if n != name]
    data = {n: np.array(t.read()) for n, t in tensors.items()}
    safetensors_io.write(path, keep, data.__getitem__, metadata)


def test_a_missing_tensor_exits_2_naming_it(tmp_path, capsys):
    folder = Path(edited(tmp_path, TIED.name))
    drop_tensor(folder, "model.layers.1.mlp.up_proj.weight")
    assert "has no tensor model.layers.1.mlp.up_proj.weight" in convert_error(
        str(folder), tmp_path, capsys
    )


def test_an_unexpected_tensor_is_named(tmp_path):
    folder = edited(tmp_path, TIED.name, num_hidden_layers=1)
    with pytest.raises(UsageError, match="holds tensor model.layers.1.input_layernorm.weight"):
        family.open_hf(folder)


def test_the_command_exits_2_without_a_traceback(tmp_path):
    folder = edited(tmp_path, TIED.name, architectures=["GPT2LMHeadModel"])
    result = cli.run("spmd.convert", "--from-hf", folder, "--to", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert "architecture GPT2LMHeadModel is not supported" in result.stderr
    assert "Traceback" not in result.stderr
