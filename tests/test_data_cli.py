"""A new user's looks at the data and the commands' edges (issue 55): `spmd data preview` on a
corpus smaller than a batch and with a tokenizer beyond 256 tokens, chat templates that fail,
a closed pipe and a full device as stdout, shell completion of the commands' actions."""

import json
from pathlib import Path

import pytest

from spmd import data
from tests.cli import ROOT

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
