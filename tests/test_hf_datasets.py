"""Hugging Face datasets as --data (spmd.io.hf_datasets): a `save_to_disk` folder and a Hub
dataset id in a local cache (laid out here, the network off) give the same tokens, so the same
batches, as the same records in JSON lines; a run on the Hub id with `--chat-template chatml`
trains, resumes with the template its checkpoint saved and exports it as transformers 5 does.
The folder was written by `datasets` itself (tests/fixtures/make_hf_dataset.py)."""

import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
from tokenizers import Tokenizer

from spmd import convert, generate
from spmd.errors import UsageError
from spmd.io import params_io, run_data, templates
from spmd.io.tokens import _load_tokenizer
from spmd.sections import DataConfig
from tests import cli
from tests.test_hub import COMMIT

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DATASET = FIXTURES / "hf_dataset"
BASE = FIXTURES / "base_tokenizer" / "tokenizer.json"
REPO = "tiny-org/chats"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """The Hub files of DATASET as the cache holds a download of dataset REPO (refs/main
    naming the commit, the files under snapshots/<commit>/), the network off."""
    root = tmp_path / "hub" / f"datasets--{REPO.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT
    for source in sorted((DATASET / "hub" / "data").glob("*.parquet")):
        (snapshot / "data").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, snapshot / "data" / source.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def stream(tmp_path: Path, data: str) -> tuple[str, np.ndarray]:
    cfg = DataConfig(
        data=data,
        tokenizer=str(BASE),
        chat_template="chatml",
        data_cache=str(tmp_path / "cache"),
        tokenize_workers=1,
    )
    token_file = run_data.open_token_file(cfg, data)
    return token_file.fingerprint, np.asarray(token_file.loss_mask())


def test_save_to_disk_folders_and_hub_ids_read_as_their_json_lines(hub_cache, tmp_path):
    saved = DATASET / "saved"
    for split in ("train", "test"):
        want, mask = stream(tmp_path, str(DATASET / f"{split}.jsonl"))
        names = [f"{saved}:{split}", str(saved / split), f"{REPO}:{split}", f"{hub_cache}:{split}"]
        if split == "train":
            names += [str(saved), REPO]  # the default split
        for name in names:
            got, got_mask = stream(tmp_path, name)
            assert got == want, name
            np.testing.assert_array_equal(got_mask, mask)
    with pytest.raises(UsageError, match="has the splits train, test, not validation"):
        stream(tmp_path, f"{saved}:validation")
    with pytest.raises(UsageError, match="names the split validation; it has train, test"):
        stream(tmp_path, f"{REPO}:validation")
    with pytest.raises(UsageError, match="nobody/missing: no such local path, and the Hugging"):
        stream(tmp_path, "nobody/missing:train")


def test_a_hub_dataset_trains_resumes_with_its_template_and_exports_it(hub_cache, tmp_path):
    run = tmp_path / "run"
    common = [
        "--model", "tiny", "--batch", "4", "--seq-len", "32", "--mesh", "dp=2",
        "--tokenizer", str(BASE), "--checkpoint-dir", str(run / "checkpoints"),
        "--metrics", str(run / "metrics.jsonl"), "--data-cache", str(tmp_path / "cache"),
        "--run-dir", "none", "--warmup", "1",
    ]  # fmt: skip
    first = cli.train_in_process(
        *common, "--data", REPO, "--chat-template", "chatml", "--steps", "2", "--stop-after", "1"
    )
    assert first.returncode == 0, first.stderr
    assert "data: format chat (told by the fields messages of" in first.stdout
    again = cli.train_in_process(*common, "--data", f"{REPO}:train", "--steps", "2")
    assert again.returncode == 0, again.stderr
    assert "resuming with the checkpoint's chat template (--chat-template chatml)" in again.stdout
    other = cli.train_in_process(
        *common, "--data", REPO, "--chat-template", "llama3", "--steps", "3"
    )
    assert other.returncode == 2 and "is not the chat template the checkpoint" in other.stderr
    # spmd.generate --chat on the checkpoint renders with the template it was trained with
    saved = params_io.saved_config(str(run / "checkpoints"), 2)
    codec = generate.Codec(_load_tokenizer(str(BASE)), str(BASE))
    ids = generate.encode_prompts(generate.GenerateConfig(chat=True), ["hi"], codec, saved)
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == [Tokenizer.from_file(str(BASE)).encode(prompt, add_special_tokens=False).ids]
    out = tmp_path / "export"
    assert convert.main(["--checkpoint", str(run / "checkpoints"), "--to-hf", str(out)]) == 0
    assert (out / "chat_template.jinja").read_text() == templates.CHATML
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
