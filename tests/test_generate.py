"""Generation with the key/value cache: greedy decoding equals greedy decoding by full
recomputation through the training forward pass and transformers' own greedy tokens, on one
device and on a 3-D mesh, with prompts of different lengths; each row stops right after its
end-of-sequence token, a batch gives each prompt what it gets alone, top-p near 0 and top-k 1
are greedy, streaming one token at a time samples what the whole loop samples; chat templates
render prompts; params come back from training checkpoints (without their optimizer state)
and converted ones; the command prints text."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from spmd import convert, generate
from spmd.errors import UsageError
from spmd.io import chat, checkpoint, eos, params_io
from spmd.run import decoding, weights
from spmd.run.decoding import Sampling
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
        generate.generate(program, params, ragged, NEW_TOKENS, Sampling(1.5), seed=seed)
        for seed in (1, 1, 2)
    )
    assert first == again and first != other
    assert first != generate.generate(program, params, ragged, NEW_TOKENS)  # not greedy


def test_top_k_samples_only_among_the_k_likeliest_tokens():
    row = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    logits = np.repeat(row[None], 256, axis=0)  # 256 draws from one distribution
    drawn = np.asarray(decoding.sample(logits, jax.random.key(0), Sampling(2.0, top_k=3)))
    assert set(drawn.tolist()) == set(np.argsort(row)[-3:].tolist())  # all three, only them
    greedy = np.asarray(decoding.sample(logits, jax.random.key(0), Sampling()))
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
    assert f"generated {NEW_TOKENS} tokens in " in result.stderr  # and how fast
    assert "tokens/s" in result.stderr.strip().splitlines()[-1]


def test_each_row_stops_right_after_its_end_of_sequence_token(one_device, reference):
    """transformers' greedy rows, with one of their tokens declared the end of sequence: each
    row ends right after its first occurrence, and the batch gives each row what it gets
    alone (rows finish at different steps; one never does)."""
    prompts, greedy = reference["input_ids"].tolist(), reference["greedy_ids"].tolist()
    stop = greedy[0][2]  # 85: third of row 0, first of row 1, third of row 3, not in row 2
    expected = [row[: row.index(stop) + 1] if stop in row else row for row in greedy]
    assert sorted(map(len, expected)) == [1, 3, 3, NEW_TOKENS]
    program, params = one_device.program, one_device.params
    batched = generate.generate(program, params, prompts, NEW_TOKENS, eos=(stop, 127))
    assert batched == expected
    alone = [generate.generate(program, params, [p], NEW_TOKENS, eos=(stop,))[0] for p in prompts]
    assert alone == expected


def test_the_decode_loop_ends_once_every_row_has_stopped(one_device, reference):
    """On the device: rows that stopped emit padding, and the loop exits when all have."""
    prompts, greedy = reference["input_ids"].tolist(), reference["greedy_ids"].tolist()
    stops = np.array(sorted({row[1] for row in greedy}), np.int32)  # every row ends by token 2
    run = decoding.decoder(one_device.program, Sampling(), NEW_TOKENS - 1)
    batch = decoding._batch(one_device.program.layout, prompts)
    key = jax.random.key(0)
    state = run.prefill(one_device.params, *batch, key, stops, NEW_TOKENS)
    _, out, steps = run.decode(one_device.params, state, key, stops, np.int32(NEW_TOKENS - 1))
    assert int(steps) == 1  # of the 7 allowed
    out = np.asarray(out)
    assert out[:, 0].tolist() == [row[1] if row[0] not in stops else 0 for row in greedy]
    assert not out[:, 1:].any()  # never written: padding


def test_the_command_stops_at_the_eos_of_generation_config(tmp_path, one_device, capsys):
    """generation_config.json's eos_token_id (a list here) wins over config.json's."""
    prompt = "Hello"
    greedy = generate.generate(
        one_device.program, one_device.params, [list(prompt.encode())], NEW_TOKENS
    )[0]
    folder = tmp_path / "hf"
    shutil.copytree(UNTIED, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [126, greedy[2]]}))
    argv = ["--from-hf", str(folder), "--prompt", prompt, "--temperature", "0", "--mesh", "dp=1"]
    assert generate.main([*argv, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    stopped = greedy[: greedy.index(greedy[2]) + 1]
    out = capsys.readouterr()
    assert out.out == prompt + bytes(stopped).decode("utf-8", errors="replace") + "\n"
    assert f"generated {len(stopped)} tokens" in out.err


def test_eos_ids_come_from_the_folder_else_from_the_tokenizer(tmp_path):
    assert eos.declared(str(UNTIED)) == [2]  # config.json's (no generation_config.json)
    assert eos.ids(None) == [] and eos.ids(7) == [7] and eos.ids([1, None, True, 3]) == [1, 3]
    folder = tmp_path / "tok"
    word_tokenizer(folder, {"eos_token": {"content": "hi"}})
    codec = generate.codec_for(
        generate.GenerateConfig(tokenizer=str(folder / "tokenizer.json")), {}, 128
    )
    assert eos.of_tokenizer(codec.path, codec.tokenizer) == [9]
    (folder / "tokenizer_config.json").unlink()  # then the end-of-text token it knows
    assert eos.of_tokenizer(codec.path, codec.tokenizer) == [2]
    checkpoint = generate.GenerateConfig(checkpoint="ckpt")
    assert generate.stop_ids(checkpoint, {eos.KEY: [5, 6]}, codec) == (5, 6)  # converted
    assert generate.stop_ids(checkpoint, {}, codec) == (2,)
    ignoring = dataclasses.replace(checkpoint, ignore_eos=True)
    assert generate.stop_ids(ignoring, {eos.KEY: [5]}, codec) == ()


def test_top_p_near_zero_and_top_k_one_are_greedy(one_device, ragged):
    program, params = one_device.program, one_device.params
    greedy = generate.generate(program, params, ragged, NEW_TOKENS)
    for how in (Sampling(1.5, top_p=1e-6), Sampling(1.5, top_k=1)):
        assert generate.generate(program, params, ragged, NEW_TOKENS, how, seed=5) == greedy


def test_top_p_samples_the_smallest_set_holding_p():
    probs = np.array([0.05, 0.5, 0.15, 0.3], np.float32)  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = np.repeat(np.log(probs)[None], 512, axis=0)
    for p, kept in [(0.4, {1}), (0.6, {1, 3}), (0.9, {1, 3, 2}), (1.0, {0, 1, 2, 3})]:
        drawn = decoding.sample(logits, jax.random.key(0), Sampling(1.0, top_p=p))
        assert set(np.asarray(drawn).tolist()) == kept, p


def test_streaming_samples_what_the_whole_loop_samples(one_device, ragged):
    """One token per call, each handed over as it comes, equals one call for all (the same
    seed draws the same tokens whatever the chunking)."""
    program, params = one_device.program, one_device.params
    how, pieces = Sampling(1.2, top_k=20, top_p=0.9), []
    whole = generate.generate(program, params, ragged, NEW_TOKENS, how, seed=3, eos=(7,))
    streamed = generate.generate(
        program, params, ragged, NEW_TOKENS, how, 3, (7,), pieces.append, stream=True
    )
    assert streamed == whole
    assert len(pieces) == max(map(len, whole))  # a token per call until the last row stops
    assert [sum((p[row] for p in pieces), []) for row in range(len(ragged))] == whole


def word_tokenizer(folder: Path, config: dict) -> None:
    """A word-level tokenizer of 12 ids (within the fixture's vocab) that adds <s> itself, in
    `folder` with `config` as its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    words = ["<unk>", "<s>", "</s>", "[", "]", "user", "assistant", "hello", "world", "hi"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_streamed_text_is_the_whole_text_without_broken_characters(tmp_path, capsys):
    folder = tmp_path / "tok"
    word_tokenizer(folder, {})
    words = generate.codec_for(
        generate.GenerateConfig(tokenizer=str(folder / "tokenizer.json")), {}, 128
    )
    for codec, ids in [
        (generate.Codec(None), list("naïve café ☕".encode())),  # 1 to 3 bytes a character
        (words, [7, 8, 9, 2, 7]),  # words spaced by the decoder; </s> (special) dropped
    ]:
        show, printed = generate.Stream(codec), []
        for token in ids:
            show([[token]])
            printed.append(capsys.readouterr().out)
        show([[]], last=True)
        assert "".join(printed) + capsys.readouterr().out == codec.decode(ids) + "\n"
        assert not any("\ufffd" in piece for piece in printed)


TEMPLATE = (  # writes the bos token itself, as Llama's templates do
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_chat_prompts_are_rendered_by_the_template(tmp_path, one_device, capsys):
    folder = tmp_path / "tok"
    word_tokenizer(folder, {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}})
    renderer = chat.Renderer(str(folder / "tokenizer.json"), "--chat")
    assert renderer.prompt("hello world") == "<s>[user] hello world [assistant]"
    cfg = generate.GenerateConfig(chat=True, tokenizer=str(folder / "tokenizer.json"))
    codec = generate.codec_for(cfg, {}, 128)
    # the template's <s> only, not the tokenizer's own as well
    assert generate.encode_prompts(cfg, ["hello world"], codec) == [[1, 3, 5, 4, 7, 8, 3, 6, 4]]
    # the command, given the tokenizer's folder: the reply alone on stdout
    expected = generate.generate(
        one_device.program, one_device.params, [[1, 3, 5, 4, 7, 8, 3, 6, 4]], 4, eos=(2,)
    )[0]
    argv = ["--from-hf", str(UNTIED), "--tokenizer", str(folder), "--chat", "--prompt"]
    argv += ["hello world", "--temperature", "0", "--max-new-tokens", "4", "--mesh", "dp=1"]
    assert generate.main(argv) == 0
    assert capsys.readouterr().out == codec.decode(expected) + "\n"
    # the newer place of a template: chat_template.jinja beside the tokenizer
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert chat.Renderer(str(folder / "tokenizer.json"), "--chat").prompt("hi") == (
        "<s>[user] hi [assistant]"
    )
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(UsageError, match="--chat: .* has no chat_template"):
        generate.encode_prompts(cfg, ["hello world"], codec)
