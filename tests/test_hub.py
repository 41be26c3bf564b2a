"""Hub ids (`org/name`) in the flags that take a Hugging Face folder or tokenizer: resolved from
a Hugging Face cache laid out here as huggingface_hub lays it out (refs/main names the commit,
snapshots/<commit>/ links into blobs/), with the network off (HF_HUB_OFFLINE); the model loads
with transformers' logits; an id neither cached nor reachable exits 2 in one line."""

import hashlib
import shutil
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest

from spmd import convert, generate, train
from spmd.errors import UsageError
from spmd.io import hub
from spmd.run import weights
from tests import cli, trainer
from tests.hf_fixtures import logits_of

TIED = Path(__file__).resolve().parent / "fixtures" / "hf_llama_tied"
REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tokenizer_json(path: Path) -> None:
    """A word-level tokenizer.json (ids within the fixture's vocab of 64)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def lay_out_repo(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """`files` (name -> source) as the cache holds a download of `repo`: each file's bytes in
    blobs/<hash>, a relative link to it under snapshots/<commit>/, and refs/main naming the
    commit. Returns the snapshot folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        blob = hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, root / "blobs" / blob)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding REPO (the tied fixture and a tokenizer), the network off.
    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when imported, so its constants are
    patched (a subprocess gets the environment variables instead)."""
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer_json(tokenizer)
    files = {p.name: p for p in TIED.iterdir() if p.suffix in (".json", ".safetensors")}
    snapshot = lay_out_repo(tmp_path / "hub", REPO, {**files, "tokenizer.json": tokenizer})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_loads_from_the_cache_with_transformers_logits(cache):
    folder = hub.model_folder(REPO, "--from-hf")
    assert Path(folder) == cache
    reference = np.load(TIED / "reference.npz")
    loaded = weights.from_hf(folder, trainer.layout("dp=1"))
    logits = logits_of(loaded, reference["input_ids"])
    np.testing.assert_allclose(logits, reference["logits"], rtol=0, atol=1e-4)
    assert hub.tokenizer_file(REPO, "--tokenizer") == str(cache / "tokenizer.json")


def test_every_flag_takes_the_hub_id(cache, capsys):
    sections = train.resolve_sections(["--init-from-hf", REPO, "--tokenizer", REPO])
    assert sections["run"].init_from_hf == str(cache)
    assert sections["data"].tokenizer == str(cache / "tokenizer.json")
    assert sections["model"].vocab_size == 64  # the folder's config.json is the model
    # generate: the weights and the tokenizer.json of the snapshot; config.json's eos (2)
    argv = ["--from-hf", REPO, "--prompt", "hello world", "--temperature", "0", "--mesh", "dp=1"]
    assert generate.main([*argv, "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("hello world")  # then the continuation


def test_local_paths_win_over_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "hf").mkdir(parents=True)
    (tmp_path / "runs" / "hf" / "tokenizer.json").write_text("{}")
    assert hub.model_folder("runs/hf", "--from-hf") == "runs/hf"  # a folder: never looked up
    assert hub.tokenizer_file("runs/hf", "--tokenizer") == str(Path("runs/hf/tokenizer.json"))
    for value in ["", "runs/hf/x", "./hf", "/abs/hf", "tokenizer.json", "a b/c", "x/.."]:
        assert not hub.is_repo_id(value), value
    assert hub.is_repo_id("meta-llama/Llama-3.2-1B")


@pytest.mark.parametrize("command", [generate, convert, train])
def test_an_id_not_cached_while_offline_exits_2_in_one_line(cache, tmp_path, command, capsys):
    argv = {
        generate: ["--from-hf", "nobody/missing", "--prompt", "x"],
        convert: ["--from-hf", "nobody/missing", "--to", str(tmp_path / "out")],
        train: ["--tokenizer", "nobody/missing", "--dry-run"],
    }[command]
    assert command.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nobody/missing" in err[0] and "HF_HUB_OFFLINE" in err[0], err


def test_an_unreachable_hub_exits_2_naming_the_id(cache, monkeypatch):
    """Online, the Hub at a port where nothing listens: refused, so the id cannot be had."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(UsageError, match="nobody/missing: .* cannot be downloaded"):
        hub.model_folder("nobody/missing", "--from-hf")
    assert hub.model_folder(REPO, "--from-hf") == str(cache)  # the cache needs no network


def test_the_command_line_exits_2_for_an_unknown_id(tmp_path):
    """HF_HUB_OFFLINE and HF_HUB_CACHE as a user sets them, read at huggingface_hub's import."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    result = cli.run("spmd.generate", "--from-hf", "nobody/missing", "--prompt", "x", env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --from-hf nobody/missing"), lines
    assert str(tmp_path) in lines[0]  # the cache it looked in


def test_a_tokenizer_folder_without_a_tokenizer_is_called_so(tmp_path):
    """An existing folder is not "no such file": the message says what it lacks."""
    with pytest.raises(UsageError, match="is a folder that holds no tokenizer.json"):
        hub.tokenizer_file(str(tmp_path), "--tokenizer")
