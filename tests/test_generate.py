"""Generation with the key/value cache: greedy decoding equals greedy decoding by full
recomputation through the training forward pass and transformers' own greedy tokens, on one
device and on a 3-D mesh, with prompts of different lengths; params come back from training
checkpoints (without their optimizer state) and converted ones; the command prints text."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from spmd import convert, generate, weights
from spmd.errors import UsageError
from spmd.io import checkpoint, params_io
from tests import cli, trainer

UNTIED = Path(__file__).resolve().parent / "fixtures" / "hf_llama_untied"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def reference():
    return np.load(UNTIED / "reference.npz")


@pytest.fixture(scope="module")
def one_device():
    return weights.from_hf(str(UNTIED), trainer.layout("dp=1"))


@pytest.fixture(scope="module")
def ragged(reference):
    """Three prompts of lengths 5, 16 and 1 (right-padded in one batch)."""
    ids = reference["input_ids"].tolist()
    return [ids[0][:5], ids[1], ids[2][:1]]


def greedy_by_recomputation(loaded: weights.Loaded, prompts: list[list[int]], n: int) -> list:
    """Each token: argmax of the full forward pass over each whole sequence so far (no cache).
    Rows are right-padded to one fixed length (causal attention: padding after a position
    does not change its logits), so the forward pass compiles once."""
    forward = jax.jit(lambda params, tokens: nnx.merge(loaded.program.graphdef, params)(tokens))
    sequences = [list(p) for p in prompts]
    tokens = np.zeros((len(prompts), max(map(len, prompts)) + n), np.int32)
    for _ in range(n):
        for row, sequence in enumerate(sequences):
            tokens[row, : len(sequence)] = sequence
        logits = np.asarray(forward(loaded.params, tokens))
        for row, sequence in enumerate(sequences):
            sequence.append(int(np.argmax(logits[row, len(sequence) - 1])))
    return [s[len(p) :] for s, p in zip(sequences, prompts, strict=True)]


def test_cached_greedy_equals_greedy_by_full_recomputation(one_device, ragged):
    cached = generate.generate(one_device.program, one_device.params, ragged, NEW_TOKENS)
    assert cached == greedy_by_recomputation(one_device, ragged, NEW_TOKENS)


def test_greedy_on_a_3d_mesh_equals_one_device_and_transformers(one_device, ragged, reference):
    mesh = weights.from_hf(str(UNTIED), trainer.layout("dp=2,fsdp=2,tp=2"))
    prompts = reference["input_ids"].tolist()
    tokens = generate.generate(mesh.program, mesh.params, prompts, NEW_TOKENS)
    assert tokens == reference["greedy_ids"].tolist()  # transformers' generate(do_sample=False)
    # 3 rows on a data-parallel size of 4: padded with a copy of the last row, then dropped
    padded = generate.generate(mesh.program, mesh.params, ragged, NEW_TOKENS)
    assert padded == generate.generate(one_device.program, one_device.params, ragged, NEW_TOKENS)


def test_sampling_depends_on_the_seed_only(one_device, ragged):
    program, params = one_device.program, one_device.params
    first, again, other = (
        generate.generate(program, params, ragged, NEW_TOKENS, 1.5, seed=seed) for seed in (1, 1, 2)
    )
    assert first == again and first != other
    assert first != generate.generate(program, params, ragged, NEW_TOKENS)  # not greedy


def test_top_k_samples_only_among_the_k_likeliest_tokens():
    row = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    logits = np.repeat(row[None], 256, axis=0)  # 256 draws from one distribution
    drawn = np.asarray(generate.sample(logits, jax.random.key(0), 2.0, top_k=3))
    assert set(drawn.tolist()) == set(np.argsort(row)[-3:].tolist())  # all three, only them
    greedy = np.asarray(generate.sample(logits, jax.random.key(0), 0.0, top_k=0))
    assert set(greedy.tolist()) == {int(np.argmax(row))}


def test_bad_generation_input_is_a_usage_error(one_device):
    program, params = one_device.program, one_device.params
    with pytest.raises(UsageError, match="token id 200, beyond the model's vocab 128"):
        generate.generate(program, params, [[1, 200]], 4)
    with pytest.raises(UsageError, match="at least one token"):
        generate.generate(program, params, [[]], 4)


def test_params_come_back_from_a_training_checkpoint_without_optimizer_state(tmp_path):
    """A training run's state holds params and AdamW state; generation reads the params only,
    onto another mesh."""
    program = trainer.program(trainer.layout("fsdp=2,tp=2", devices=4))
    rng = np.random.default_rng(0)
    params, opt_state = jax.tree.map(  # real AdamW state structure, any values
        lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding),
        (program.abstract_params, program.abstract_opt_state),
    )
    manager = checkpoint.open_manager(str(tmp_path / "run"), keep=1)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"a tokenizer": "the run trained with"}')
    config = {"model": dataclasses.asdict(trainer.tiny_config()), "train": {"tokenizer": ""}}
    config["train"]["tokenizer"] = str(tokenizer)
    state = {"params": params, "opt_state": opt_state}
    checkpoint.save(manager, 7, state, {"step": 7}, config)
    manager.close()
    loaded = weights.from_checkpoint(str(tmp_path / "run"), 0, trainer.layout("dp=2,tp=4"))
    assert loaded.source.endswith("step 7") and loaded.model == trainer.tiny_config()
    for saved, restored in zip(
        jax.tree.leaves(params), jax.tree.leaves(loaded.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(saved))
    # exported to Hugging Face, the run's tokenizer goes along
    out = tmp_path / "hf"
    assert convert.main(["--checkpoint", str(tmp_path / "run"), "--to-hf", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()


def test_the_command_prints_the_prompt_and_its_continuation(tmp_path, one_device):
    converted = str(tmp_path / "converted")
    params_io.save_converted(
        converted, one_device.params, {"model": dataclasses.asdict(one_device.model)}, str(UNTIED)
    )
    prompt = "Hello, spmd"  # byte-level: the fixture's vocab 128 holds ASCII
    expected = generate.generate(
        one_device.program, one_device.params, [list(prompt.encode())], NEW_TOKENS
    )[0]
    args = ["--checkpoint", converted, "--prompt", prompt, "--temperature", "0"]
    result = cli.run(
        "spmd.generate", *args, "--max-new-tokens", str(NEW_TOKENS), "--mesh", "dp=2,tp=2"
    )
    assert result.returncode == 0, result.stderr
    text = prompt + bytes(expected).decode("utf-8", errors="replace") + "\n"
    assert result.stdout == text.replace("\r\n", "\n").replace("\r", "\n")  # text mode
    assert f"1 x {NEW_TOKENS} tokens" in result.stderr
