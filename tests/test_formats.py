"""Dataset formats (`--data-format`, `--data-fields`), the chat template override
(`--chat-template`) and `--train-on-input` (spmd.io.formats, spmd.io.templates): ShareGPT and
OpenAI messages give the same tokens and loss masks, an alpaca record the Alpaca prompt's
bytes, the built-in templates what transformers renders with them (a fixture made once by
tests/fixtures/make_chat_templates.py), and bad input exits 2 in one line."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from spmd import data as data_command
from spmd.errors import UsageError
from spmd.io import chat, formats, run_data
from spmd.sections import DataConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BASE = FIXTURES / "base_tokenizer" / "tokenizer.json"  # no chat template of its own
RENDERED = json.loads((FIXTURES / "chat_templates.json").read_text())["templates"]
CONVERSATIONS = [case["messages"] for case in RENDERED["chatml"]]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def token_stream(tmp_path: Path, **flags) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(token ids, loss mask, fingerprint) of --data read with `flags` (DataConfig fields)."""
    cfg = DataConfig(data_cache=str(tmp_path / "cache"), tokenize_workers=1, **flags)
    run_data.check_choices(cfg)
    token_file = run_data.open_token_file(cfg, cfg.data)
    mask = token_file.loss_mask()
    return (
        np.asarray(token_file.load()),
        None if mask is None else np.asarray(mask),
        (token_file.fingerprint),
    )


def test_sharegpt_and_openai_messages_give_the_same_tokens_and_masks(tmp_path, capsys):
    messages = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    sharegpt = [
        [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in c]
        for c in CONVERSATIONS
    ]
    shared = write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": c} for c in sharegpt])
    renamed = [[{"speaker": m["from"], "text": m["value"]} for m in c] for c in sharegpt]
    pq.write_table(pa.table({"dialog": renamed}), tmp_path / "renamed.parquet")
    common = {"tokenizer": str(BASE), "chat_template": "chatml"}
    ids, mask, _ = token_stream(tmp_path, data=str(messages), **common)
    assert "data: format chat (told by the fields messages of" in capsys.readouterr().out
    for flags in (
        {"data": str(shared)},
        {
            "data": str(tmp_path / "renamed.parquet"),
            "data_format": "sharegpt",
            "data_fields": "conversations=dialog,from=speaker,value=text",
        },
    ):
        other_ids, other_mask, _ = token_stream(tmp_path, **flags, **common)
        np.testing.assert_array_equal(other_ids, ids)
        np.testing.assert_array_equal(other_mask, mask)
    # the counted tokens are the assistant turns (their text and <|im_end|>\n) and each end
    bpe = Tokenizer.from_file(str(BASE))
    counted = bpe.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert counted == "4.<|im_end|>\n<|endoftext|> hello! <|im_end|>\nbye.<|im_end|>\n<|endoftext|>"
    # --train-on-input: every token of the rendering counts
    _, everything, _ = token_stream(tmp_path, data=str(shared), train_on_input=True, **common)
    assert everything.all() and len(everything) == len(ids)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_a_builtin_template_renders_what_transformers_renders(name):
    """tests/fixtures/chat_templates.json: transformers' apply_chat_template with the same
    template text on a tokenizer without one; spmd's rendering, its tokens (the template's
    own special tokens, no others) and its generation prompt are the same."""
    render = chat.Renderer(str(BASE), "--chat-template", name)
    bpe = Tokenizer.from_file(str(BASE))
    for case in RENDERED[name]:
        text, spans = render(case["messages"])
        assert text == case["text"]
        assert bpe.encode(text, add_special_tokens=False).ids == case["ids"]
        assert text[: spans[0][0]] == case["prompt"]  # where the first reply starts
        if case["messages"][0]["role"] == "user":  # spmd.generate --chat's prompt
            assert render.prompt(case["messages"][0]["content"]) == case["prompt"]
        replies = [m["content"] for m in case["messages"] if m["role"] == "assistant"]
        assert len(spans) == len(replies)
        for (start, end), reply in zip(spans, replies, strict=True):
            assert reply.strip() in text[start:end]


ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
    "add the numbers\n\n### Input:\n2 and 3\n\n### Response:\n"
)
ALPACA_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\nsay hi\n\n### Response:\n"
)


def test_an_alpaca_record_is_the_alpaca_prompt_and_its_output(tmp_path):
    records = [
        {"instruction": "add the numbers", "input": "2 and 3", "output": "5"},
        {"instruction": "say hi", "input": "", "output": "hi"},
    ]
    path = write_jsonl(tmp_path / "alpaca.jsonl", records)
    ids, mask, _ = token_stream(tmp_path, data=str(path))  # byte-level: the UTF-8 bytes
    expected = [(ALPACA_WITH_INPUT, "5"), (ALPACA_WITHOUT_INPUT, "hi")]
    want = b"".join(p.encode() + r.encode() + b"\0" for p, r in expected)
    assert ids.tobytes() == np.frombuffer(want, np.uint8).astype(ids.dtype).tobytes()
    want_mask = [m for p, r in expected for m in [0] * len(p) + [1] * (len(r) + 1)]
    np.testing.assert_array_equal(mask, want_mask)
    # a Parquet table without the input column reads alike; --train-on-input counts it all
    no_input = pa.table({"instruction": ["say hi"], "output": ["hi"]})
    pq.write_table(no_input, tmp_path / "alpaca.parquet")
    ids, mask, _ = token_stream(
        tmp_path, data=str(tmp_path / "alpaca.parquet"), data_format="alpaca", train_on_input=True
    )
    assert (
        ids.tobytes()
        == np.frombuffer(ALPACA_WITHOUT_INPUT.encode() + b"hi\0", np.uint8)
        .astype(ids.dtype)
        .tobytes()
    )
    assert mask.all()


def test_bad_format_input_exits_2_naming_the_value(tmp_path, capsys):
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt"}]
    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}]
        + [{"conversations": sharegpt}],
    )
    with pytest.raises(UsageError, match=rf"{bad} line 2 has a message 1 without a string 'value'"):
        token_stream(tmp_path, data=str(bad), tokenizer=str(BASE), chat_template="chatml")
    alpaca = write_jsonl(
        tmp_path / "alpaca.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c"}]
    )
    with pytest.raises(UsageError, match=rf"{alpaca} line 2 has no field 'output'"):
        token_stream(tmp_path, data=str(alpaca), data_format="alpaca")
    both = write_jsonl(tmp_path / "both.jsonl", [{"text": "a", "messages": []}])
    with pytest.raises(UsageError, match="fit text and chat; give --data-format text or chat"):
        token_stream(tmp_path, data=str(both))
    neither = write_jsonl(tmp_path / "neither.jsonl", [{"body": "a"}])
    with pytest.raises(UsageError, match=r"\(body\) are none of the formats'"):
        token_stream(tmp_path, data=str(neither))
    messages = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONVERSATIONS[0]}])
    base = ["stats", "--data", str(messages), "--tokenizer", str(BASE)]
    for extra, said in [
        (["--chat-template", "vicuna"], "--chat-template 'vicuna' is not a template: give "
         "chatml, llama3 or a file ending .jinja"),
        (["--data-format", "openai"], "--data-format 'openai' is not one of auto, text, chat, "
         "sharegpt, alpaca, preference"),
        (["--data-format", "sharegpt", "--data-fields", "role=speaker"], "--data-fields: 'role' "
         "is not a field of --data-format sharegpt; its keys are conversations, from, value"),
        (["--data-fields", "speaker=from"], "--data-fields 'speaker=from': 'speaker' is not a "
         "field key"),
    ]:  # fmt: skip
        assert data_command.main([*base, *extra, "--data-cache", str(tmp_path / "c")]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert said in line, line


def test_field_flags_of_older_runs_still_name_the_fields():
    cfg = DataConfig(messages_field="dialog", chat_template="chatml")
    fields = formats.legacy_fields(cfg)
    assert fields == formats.Fields(messages="dialog", template="chatml")
    with pytest.raises(UsageError, match="with the older field flags"):
        formats.check(dataclasses.replace(cfg, data_format="chat"))
