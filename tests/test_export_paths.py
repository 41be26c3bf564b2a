"""The export path as a user takes it (spmd.convert, spmd.generate, spmd.checkpoint verify on a
LoRA run; spmd.io.run_paths, spmd.lora_base, spmd.training.occupied): a run started from its
parent folder with relative paths (`--init-from-hf base --tokenizer base/tokenizer.json
--run-dir runs/lora`) is exported from there with relative paths, and again from another
folder after the run moved; a moved base is named with --lora-base; a checkpoint of an older
spmd, which recorded those paths relative, still resolves; and no output lands in a run's
folders. One small training run, shared by the module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from spmd import checkpoint as checkpoint_cli
from spmd import convert, generate, lora_base, train
from spmd.errors import UsageError
from spmd.io import manifest, params_io, run_paths
from spmd.training.folder_lock import FolderLocks
from tests import cli

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUN = ("--init-from-hf", "base", "--tokenizer", "base/tokenizer.json", "--run-dir", "runs/lora")
CHECKPOINTS = "runs/lora/checkpoints"
TEXT = {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A user's folder: base/ (the untied Llama fixture with the chat tokenizer's files beside
    its weights, as a Hugging Face folder has them), a corpus, and runs/lora: 2 LoRA steps
    started from this folder with relative paths, a checkpoint at step 2."""
    top = tmp_path_factory.mktemp("user")
    shutil.copytree(FIXTURES / "hf_llama_untied", top / "base")
    for text_file in (FIXTURES / "chat_tokenizer").iterdir():
        shutil.copy(text_file, top / "base")
    rng = np.random.default_rng(0)
    (top / "corpus.txt").write_text(" ".join(rng.choice(["ab", "cd ", "efg", "hi"], 3000)))
    args = [*RUN, "--data", "corpus.txt", "--lora-rank", "4", "--steps", "2", "--batch", "4"]
    args += ["--seq-len", "16", "--eval-fraction", "0", "--checkpoint-every", "2"]
    args += ["--mesh", "fsdp=2", "--data-cache", "cache"]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(top)
        assert train.main(args) == 0
    return top


def saved_config(checkpoints: Path) -> dict:
    return json.loads((checkpoints / "2" / "config" / "metadata").read_text())


def last_error(capsys) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ")
    return line


def test_the_checkpoint_records_its_base_and_tokenizer_absolute(user):
    config = saved_config(user / CHECKPOINTS)
    assert config[lora_base.KEY]["base"] == str(user / "base")
    assert config[run_paths.TOKENIZER_KEY] == str(user / "base" / "tokenizer.json")
    assert config["data"]["tokenizer"] == "base/tokenizer.json"  # the flag as given, for resume


def test_to_peft_from_the_runs_parent_folder(user):
    """The usual layout: the current folder holds the checkpoint (a real process)."""
    result = cli.run("spmd.convert", "--checkpoint", CHECKPOINTS, "--to-peft", "adapter", cwd=user)
    assert result.returncode == 0, result.stderr
    adapter = json.loads((user / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(user / "base")  # peft reads it anywhere


def test_to_peft_with_absolute_paths_from_the_runs_parent_folder(user, monkeypatch):
    monkeypatch.chdir(user)
    out = user / "adapter_abs"
    assert convert.main(["--checkpoint", str(user / CHECKPOINTS), "--to-peft", str(out)]) == 0
    assert (out / "adapter_model.safetensors").is_file()


def test_to_hf_from_the_runs_parent_folder_writes_the_tokenizer_files(user, monkeypatch):
    monkeypatch.chdir(user)
    assert convert.main(["--checkpoint", CHECKPOINTS, "--to-hf", "export"]) == 0
    written = {p.name for p in (user / "export").iterdir()}
    assert TEXT <= written, written
    assert (user / "export" / "tokenizer.json").read_bytes() == (
        user / "base" / "tokenizer.json"
    ).read_bytes()


def test_a_moved_run_is_read_from_another_folder(user, monkeypatch, capsys):
    moved = user / "moved" / "lora"
    shutil.copytree(user / "runs" / "lora", moved)
    elsewhere = user / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    checkpoints = "../moved/lora/checkpoints"
    assert convert.main(["--checkpoint", checkpoints, "--to-peft", "adapter"]) == 0
    assert convert.main(["--checkpoint", checkpoints, "--to-hf", "export"]) == 0
    assert TEXT <= {p.name for p in (elsewhere / "export").iterdir()}
    prompt = ["--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0"]
    assert generate.main(["--checkpoint", checkpoints, *prompt]) == 0
    assert checkpoint_cli.main(["verify", "../moved/lora"]) == 0
    assert f"base {user / 'base'}: sha256" in capsys.readouterr().out


def test_a_moved_base_is_named_with_lora_base_and_verify_calls_no_step_damaged(
    user, monkeypatch, capsys
):
    monkeypatch.chdir(user)
    (user / "base").rename(user / "base_moved")
    try:
        args = ["--checkpoint", CHECKPOINTS, "--to-peft", "adapter_moved"]
        assert convert.main(args) == 2
        line = last_error(capsys)
        assert "--lora-base DIR" in line and "--init-from-hf" not in line, line
        prompt = ["--checkpoint", CHECKPOINTS, "--prompt", "ab"]
        assert generate.main(prompt) == 2
        assert "give it with --tokenizer PATH" in last_error(capsys)
        assert generate.main([*prompt, "--tokenizer", "base_moved"]) == 2
        assert "--lora-base DIR" in last_error(capsys)
        assert checkpoint_cli.main(["verify", CHECKPOINTS]) == 0  # the step is whole
        out = capsys.readouterr().out
        assert "base not checked" in out and "--lora-base" in out and "damaged" not in out
        assert convert.main([*args, "--lora-base", "base_moved"]) == 0
        adapter = json.loads((user / "adapter_moved" / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str(user / "base_moved")
        verified = checkpoint_cli.main(["verify", CHECKPOINTS, "--lora-base", "base_moved"])
        assert verified == 0 and "sha256" in capsys.readouterr().out
        # the tokenizer moved with the base: an export names the flag rather than drop it
        hf_args = ["--checkpoint", CHECKPOINTS, "--to-hf", "export_moved"]
        assert convert.main([*hf_args, "--lora-base", "base_moved"]) == 2
        assert "give it with --tokenizer PATH" in last_error(capsys)
        given = ["--lora-base", "base_moved", "--tokenizer", "base_moved"]
        assert convert.main([*hf_args, *given]) == 0
        assert TEXT <= {p.name for p in (user / "export_moved").iterdir()}
    finally:
        (user / "base_moved").rename(user / "base")


def test_another_base_under_lora_base_names_that_flag(user, monkeypatch, capsys):
    monkeypatch.chdir(user)
    other = user / "other_base"
    shutil.copytree(FIXTURES / "hf_llama_tied", other)  # other weights, for another model
    args = ["--checkpoint", CHECKPOINTS, "--to-peft", "adapter_other", "--lora-base", "other_base"]
    assert convert.main(args) == 2
    line = last_error(capsys)
    assert "give that base with --lora-base" in line, line


def test_a_checkpoint_recording_relative_paths_resolves_where_its_run_started(user, monkeypatch):
    """An older spmd's checkpoint: base and tokenizer as typed, relative to the folder the run
    started in; the whole tree moved, read from another folder."""
    tree = user / "old_tree"
    shutil.copytree(user / "base", tree / "base")
    shutil.copytree(user / "runs" / "lora", tree / "runs" / "lora")
    step = tree / CHECKPOINTS / "2"
    config = saved_config(tree / CHECKPOINTS)
    config[lora_base.KEY]["base"] = "base"
    del config[run_paths.TOKENIZER_KEY]
    (step / "config" / "metadata").write_text(json.dumps(config))
    manifest.write(step)  # as the older spmd saved it
    reader = user / "reader"
    reader.mkdir()
    monkeypatch.chdir(reader)
    checkpoints, out, adapter = str(tree / CHECKPOINTS), reader / "export", reader / "adapter"
    assert convert.main(["--checkpoint", checkpoints, "--to-hf", str(out)]) == 0
    assert TEXT <= {p.name for p in out.iterdir()}
    assert convert.main(["--checkpoint", checkpoints, "--to-peft", str(adapter)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tree / "base")


@pytest.mark.parametrize(
    "output, named",
    [
        (f"--to-peft {CHECKPOINTS}/adapter", "is inside --checkpoint"),
        ("--to-hf runs", "holds --checkpoint"),
        ("--to-hf .", "holds --checkpoint"),
        ("--to-hf runs/lora/export", "a run folder"),
        ("--to-peft runs/lora/logs/adapter", "a run folder"),
    ],
)
def test_an_output_in_the_input_or_a_run_folder_is_refused(
    user, monkeypatch, capsys, output, named
):
    monkeypatch.chdir(user)
    flag, target = output.split()
    assert convert.main(["--checkpoint", CHECKPOINTS, flag, target]) == 2
    assert named in last_error(capsys)
    assert not (user / target).exists() or target in ("runs", ".")


def test_a_folder_in_use_is_refused_and_a_finished_conversion_says_so_for_convert(
    user, monkeypatch, capsys
):
    monkeypatch.chdir(user)
    with FolderLocks(["live"]) as locks:  # a live run (this process) writing live/
        locks.acquire(say=lambda line: None)
        for target in ("live", "live/ck"):
            assert convert.main(["--from-hf", "base", "--to", target]) == 2
            assert "in use" in last_error(capsys)
        assert convert.main(["--checkpoint", CHECKPOINTS, "--to-hf", "live/hf"]) == 2
        assert "in use" in last_error(capsys)
    assert convert.main(["--from-hf", "base", "--to", "converted"]) == 0
    assert not (user / "converted" / ".spmd-lock").exists()  # held while writing only
    with pytest.raises(UsageError, match="--to converted already holds") as refused:
        params_io.save_converted("converted", {}, {}, "base")  # a second conversion's race
    assert "--resume" not in str(refused.value)
