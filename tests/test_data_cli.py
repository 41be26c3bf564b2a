"""A new user's looks at the data and the commands' edges (issue 55): `spmd data preview` on a
corpus smaller than a batch and with a tokenizer beyond 256 tokens, chat templates that fail,
a closed pipe and a full device as stdout, shell completion of the commands' actions."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spmd import data
from tests.cli import CACHE_HOME, ROOT

CHAT_TOKENIZER = ROOT / "tests" / "fixtures" / "chat_tokenizer"
DOCUMENTS = [
    "the quick brown fox jumps over the lazy dog; " * 4,
    "a second and shorter document, with other words: hello, world",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two JSONL documents and a byte-level BPE tokenizer of more than 256 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    with (root / "two.jsonl").open("w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in DOCUMENTS)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(DOCUMENTS * 10, trainer)
    bpe.save(str(root / "tokenizer.json"))
    return root


def preview_args(corpus: Path) -> list[str]:
    return [
        "--data", str(corpus / "two.jsonl"), "--tokenizer", str(corpus / "tokenizer.json"),
        "--data-cache", str(corpus / "cache"), "--seq-len", "16",
    ]  # fmt: skip


def test_preview_needs_no_batch_and_no_model_vocabulary(corpus, capsys):
    """The default --batch 32 is more than the corpus's windows, and the tokenizer's ids pass
    any preset's 256: neither matters to a look at the data."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    ids = [i for text in DOCUMENTS for i in tokenizer.encode(text).ids]
    assert max(ids) >= 256  # beyond every shipped preset's vocabulary
    assert data.main(["preview", *preview_args(corpus), "--windows", "50"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    windows = out.split("=== window ")[1:]
    n_train = int(out.split(" train / ")[0].rsplit(" ", 1)[1])
    assert n_train < 32 and len(windows) == n_train  # every train window, once
    shown = {w.split(" window ", 1)[1].split(")", 1)[0] for w in windows}
    assert shown == {str(i) for i in range(n_train)}
    assert "¶«the» quick brown fox" in out and "¶a second and shorter" in out
    assert data.main(["stats", *preview_args(corpus)]) == 0
    assert "documents: 2, longest " in capsys.readouterr().out
    # the data command has no model: --model is no flag of it (its message named --vocab-size)
    with pytest.raises(SystemExit, match="2"):
        data.main(["preview", *preview_args(corpus), "--model", "tiny"])
    assert capsys.readouterr().err.startswith("error: unknown flag --model")


FAILING_TEMPLATES = {  # a chat template that fails, and the reason its one line gives
    "{% for i in range(100000000) %}x{% endfor %}": "OverflowError: Range too big",
    "{% for i in range(90000) %}{% for j in range(90000) %}x{% endfor %}{% endfor %}": (
        "OverflowError: its ranges yield more than 1,000,000 numbers in one rendering"
    ),
    "{{ 'x' * 1000000000 }}": "OverflowError: a `*` makes more than 10,000,000 items",
    "{{ messages | length / 0 }}": "ZeroDivisionError: division by zero",
}


def chat_tokenizer_with(folder: Path, template: str) -> Path:
    """A copy of the chat tokenizer fixture whose chat template is `template`."""
    shutil.copytree(CHAT_TOKENIZER, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**settings, "chat_template": template})
    )
    return folder / "tokenizer.json"


@pytest.mark.parametrize("template", FAILING_TEMPLATES)
def test_a_failing_chat_template_is_one_line_in_preview(template, tmp_path, capsys):
    tokenizer = chat_tokenizer_with(tmp_path / "tok", template)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    argv = ["preview", "--data", str(tmp_path / "chats.jsonl"), "--messages-field", "messages"]
    argv += ["--tokenizer", str(tokenizer), "--data-cache", str(tmp_path / "cache")]
    assert data.main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --data {tmp_path / 'chats.jsonl'} line 1: the chat template ")
    assert FAILING_TEMPLATES[template] in line


def test_a_failing_chat_template_is_one_line_in_generate(tmp_path, capsys):
    from spmd import generate

    template = next(iter(FAILING_TEMPLATES))
    tokenizer = chat_tokenizer_with(tmp_path / "tok", template)
    hf = ROOT / "tests" / "fixtures" / "hf_llama_untied"
    argv = ["--from-hf", str(hf), "--tokenizer", str(tokenizer), "--chat", "--prompt", "hi"]
    assert generate.main([*argv, "--mesh", "dp=1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --chat: prompt 1: the chat template fails (OverflowError: ")


def spmd_command(*args: str, stdout: Any) -> subprocess.Popen:
    """`spmd ARGS` as the console script runs it (spmd.cli), a real process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-m", "spmd.cli", *args],
        cwd=ROOT,
        env={**env, "XDG_CACHE_HOME": CACHE_HOME},
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_reader_that_closes_the_pipe_ends_preview_quietly(corpus):
    """`spmd data preview | head`, with the reader gone before the first line: no traceback,
    and the status of a command that SIGPIPE ended (141), as git's."""
    process = spmd_command("data", "preview", *preview_args(corpus), stdout=subprocess.PIPE)
    process.stdout.close()  # before the interpreter has even started
    assert process.stderr.read() == ""
    assert process.wait(timeout=120) == 141


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_device_as_stdout_is_one_line(monkeypatch, capsys):
    """`spmd completion bash > /dev/full`, in-process on the real device."""
    from spmd import cli

    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert cli.main(["completion", "bash"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: stdout (/dev/full) takes no more output (No space left on device); send the "
        "output to a file or a pipe that can take it"
    ]


COMPLETE = """source {script}
try() {{ COMP_WORDS=("$@"); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))
  COMPREPLY=(); _shtab_spmd spmd "${{COMP_WORDS[-1]}}" "${{COMP_WORDS[-2]}}"
  echo "${{COMPREPLY[*]}}"; }}
try spmd data ''
try spmd data preview --wind
try spmd checkpoint ''
try spmd checkpoint verify ''
try spmd checkpoint verify --st
try spmd plan --gpu ''
"""


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash to run the completion script")
def test_completion_knows_the_actions_and_the_gpus(tmp_path, capsys):
    from spmd import checkpoint, completion
    from spmd.estimate import search

    assert completion.main(["bash"]) == 0
    script = tmp_path / "spmd.bash"
    script.write_text(capsys.readouterr().out)
    (tmp_path / "runs").mkdir()
    (tmp_path / "notes.txt").write_text("")
    shell = tmp_path / "try.sh"
    shell.write_text(COMPLETE.format(script=script))
    lines = subprocess.run(
        ["bash", str(shell)], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert lines == [
        " ".join(data.ACTIONS),
        "--windows",
        " ".join(checkpoint.ACTIONS),
        "runs",  # folders only, after the action
        "--step",
        " ".join(search.GPUS),
    ]


def test_a_hub_dataset_id_not_cached_while_offline_exits_2_in_one_line(
    tmp_path, monkeypatch, capsys
):
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)  # where no HuggingFaceH4/ folder is
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    argv = ["--data", "HuggingFaceH4/ultrachat_200k", "--messages-field", "messages"]
    assert data.main(["stats", *argv, "--data-cache", str(tmp_path / "cache")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "error: --data HuggingFaceH4/ultrachat_200k: no such local path, and the Hugging Face "
        "Hub dataset HuggingFaceH4/ultrachat_200k is not (completely) in the local cache"
    )
    assert "HF_HUB_OFFLINE forbids downloading it" in line and "--repo-type dataset" in line


def test_the_report_hint_shows_only_where_matplotlib_is_missing(tmp_path, monkeypatch):
    from spmd import train
    from spmd.run import config
    from spmd.training.run_folder import report_command

    run = tmp_path / "run"
    cfg = config.Config.of(train.resolve_sections(["--model", "tiny", "--run-dir", str(run)]))
    assert report_command(cfg) == f"python -m spmd.report {run}"  # matplotlib is installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails
    with pytest.raises(ImportError):
        import matplotlib  # noqa: F401
    hint = "  (matplotlib: pip install -e '.[report]')"
    assert report_command(cfg) == f"python -m spmd.report {run}{hint}"


def test_the_readme_tour_shows_lora_with_flags_the_commands_have():
    from spmd import commands
    from spmd.run import parser

    lines = [
        line.split("  #")[0].split()
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("python -m spmd.")
    ]
    assert any("--lora-rank" in line for line in lines)
    assert any("--to-peft" in line for line in lines)
    modules = {module for module, _ in commands.COMMANDS.values()}
    for words in lines:
        module, argv = words[2], words[3:]
        argv = argv[: argv.index("--")] if "--" in argv else argv  # (launch's command follows)
        assert module in modules, words
        own = parser.built_parser(importlib.import_module(module).main)
        flags = {flag for action in own._actions for flag in action.option_strings}
        assert {word for word in argv if word.startswith("--")} <= flags, words
