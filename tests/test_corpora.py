"""Record corpora: JSONL / JSONL.gz / Parquet / Arrow shards read by field, bad records named or
counted, shards tokenized by a process pool into the cache, an interrupted tokenization resumed.
All data is written here (json, gzip, pyarrow)."""

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmd.errors import UsageError
from spmd.io import corpora, shards

TEXTS = [f"doc {i}: " + "lorem ipsum " * (i % 5 + 1) + "é" for i in range(40)]


def write_shards(folder: Path) -> list[str]:
    """The TEXTS over five shards of every format, in the sorted order of their names."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:10]))
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t, "id": 1}) + "\n" for t in TEXTS[10:20])
    pq.write_table(pa.table({"id": range(10), "text": TEXTS[20:30]}), folder / "c.parquet")
    table = pa.table({"text": TEXTS[30:35]})
    with pa.ipc.new_file(str(folder / "d.arrow"), table.schema) as writer:  # IPC file format
        writer.write_table(table)
    with pa.ipc.new_stream(str(folder / "e.arrow"), table.schema) as writer:  # stream format
        writer.write_table(pa.table({"text": TEXTS[35:]}))
    (folder / "notes.txt").write_text("not a shard")
    return TEXTS


def byte_tokens(texts: list[str]) -> np.ndarray:
    return np.frombuffer(b"".join(t.encode() + b"\0" for t in texts), np.uint8)


def test_every_format_folder_and_glob_tokenized_by_a_pool(tmp_path):
    texts = write_shards(tmp_path / "corpus")
    lines = []
    token_file = shards.open_records(
        str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), workers=2, say=lines.append
    )
    np.testing.assert_array_equal(token_file.load(), byte_tokens(texts))
    ends = np.cumsum([len(t.encode()) + 1 for t in texts])
    np.testing.assert_array_equal(token_file.document_ends(), ends)
    assert token_file.loss_mask() is None
    assert "tokenized 5/5 shards: 40 documents" in lines[-1] and "tokens/s, ETA" in lines[-1]
    assert not list((tmp_path / "cache").glob("shards-*"))  # the pieces are joined, removed
    again = shards.open_records(
        str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), say=lines.append
    )
    assert again == token_file and len(lines) == 5  # a cache hit tokenizes nothing
    parquet_only = shards.open_records(
        str(tmp_path / "corpus" / "*.parquet"), cache_dir=str(tmp_path / "cache"), say=print
    )
    np.testing.assert_array_equal(parquet_only.load(), byte_tokens(texts[20:30]))
    assert corpora.is_record_corpus(str(tmp_path / "corpus" / "*.jsonl*"))
    assert not corpora.is_record_corpus(str(tmp_path / "corpus" / "notes.txt"))


def test_interrupted_tokenization_resumes_from_finished_shards(tmp_path):
    texts = write_shards(tmp_path / "corpus")
    cache = str(tmp_path / "cache")

    def interrupt_after_two(line: str) -> None:
        if line.startswith("tokenized 2/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        shards.open_records(
            str(tmp_path / "corpus"), cache_dir=cache, workers=1, say=interrupt_after_two
        )
    assert len(list((tmp_path / "cache").glob("shards-*/*.json"))) == 2
    lines = []
    token_file = shards.open_records(
        str(tmp_path / "corpus"), cache_dir=cache, workers=1, say=lines.append
    )
    assert lines[0] == "data: resuming tokenization, 2 of 5 shards already done"
    assert lines[1].startswith("tokenized 3/5 shards")
    np.testing.assert_array_equal(token_file.load(), byte_tokens(texts))


def test_prompt_response_records_carry_a_loss_mask(tmp_path):
    pairs = [("Q: 2+2?", " A: 4"), ("Q: capital of France?", " A: Paris")]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    fields = corpora.Fields(prompt="prompt", response="response")
    token_file = shards.open_records(str(path), cache_dir=str(tmp_path), fields=fields, say=print)
    expected_mask = np.concatenate(
        [np.r_[np.zeros(len(p), np.uint8), np.ones(len(r) + 1, np.uint8)] for p, r in pairs]
    )
    np.testing.assert_array_equal(token_file.load(), byte_tokens([p + r for p, r in pairs]))
    np.testing.assert_array_equal(token_file.loss_mask(), expected_mask)
    with pytest.raises(UsageError, match="give both"):
        shards.open_records(str(path), cache_dir=str(tmp_path), fields=corpora.Fields(prompt="p"))


def test_bad_records_exit_naming_file_and_line_or_are_counted(tmp_path):
    lines = [{"text": "fine"}, "{broken", {"title": "no text"}, {"text": None}, {"text": "ok"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    cache = str(tmp_path / "cache")
    with pytest.raises(UsageError, match=rf"{path} line 2 is not a JSON object.*skip-bad"):
        shards.open_records(str(path), cache_dir=cache, say=print)
    said = []
    token_file = shards.open_records(str(path), cache_dir=cache, skip_bad=True, say=said.append)
    np.testing.assert_array_equal(token_file.load(), byte_tokens(["fine", "ok"]))
    assert said[-1].startswith("data: skipped 3 bad record(s) (--skip-bad-records), e.g. ")
    assert f"{path} line 3 has no field 'text' (fields: title)" in said[-1]

    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["x"]}), table)
    with pytest.raises(UsageError, match=rf"{table} has no column 'text' \(columns: body\)"):
        shards.open_records(str(table), cache_dir=cache, say=print)
    pq.write_table(pa.table({"text": ["x", None, "y"]}), table)
    with pytest.raises(UsageError, match=rf"{table} row 1 has no string in column 'text'"):
        shards.open_records(str(table), cache_dir=cache, say=print)
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(UsageError, match=rf"--data {damaged}: cannot read it as parquet"):
        shards.open_records(str(damaged), cache_dir=cache, skip_bad=True, say=print)
    pair = tmp_path / "pair"  # in a pool, the bad shard's error reaches the user
    pair.mkdir()
    pq.write_table(pa.table({"text": ["fine"]}), pair / "a.parquet")
    damaged.rename(pair / "b.parquet")
    with pytest.raises(UsageError, match=rf"--data {pair / 'b.parquet'}: cannot read it as parq"):
        shards.open_records(str(pair), cache_dir=cache, workers=2, say=print)
    with pytest.raises(UsageError, match="no record shards"):
        shards.open_records(str(tmp_path / "*.csv"), cache_dir=cache)


def test_cli_mixture_of_parquet_and_jsonl_with_named_eval_sets(tmp_path):
    from tests.cli import records, run

    write_shards(tmp_path / "web")
    code = tmp_path / "code.jsonl"
    code.write_text(
        "".join(json.dumps({"text": f"def f{i}(): return {i}\n"}) + "\n" for i in range(300))
    )
    metrics = tmp_path / "m.jsonl"
    common = ("--model", "tiny", "--seq-len", "16", "--batch", "8", "--mesh", "dp=2")
    result = run(
        "spmd.train",
        *common,
        *("--data", f"web={tmp_path / 'web'}/*.parquet:0.7,code={code}:0.3"),
        *("--steps", "2", "--eval-every", "0", "--eval-batches", "1"),
        *("--eval-data", f"arrow={tmp_path / 'web'}/*.arrow", "--metrics", str(metrics)),
        *("--eval-fraction", "0.1", "--tokenize-workers", "1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mixture: web 6/8 rows (weight 0.7), code 2/8 rows (weight 0.3)" in result.stdout
    lines = records(metrics)
    train = [r for r in lines if r["kind"] == "train"]
    assert train[-1]["source_tokens"] == {"web": 2 * 6 * 16, "code": 2 * 2 * 16}
    (evaluation,) = [r for r in lines if r["kind"] == "eval"]
    assert set(evaluation["losses"]) == {"web", "code", "arrow"}
    assert all(0 < loss < 7 for loss in evaluation["losses"].values())


def test_hugging_face_tokenizer_on_records(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = write_shards(tmp_path / "corpus")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"])
    )
    path = tmp_path / "tokenizer.json"
    bpe.save(str(path))
    token_file = shards.open_records(
        str(tmp_path / "corpus"), str(path), str(tmp_path / "cache"), workers=2, say=print
    )
    end = bpe.token_to_id("<|endoftext|>")
    expected = [i for t in texts for i in [*bpe.encode(t).ids, end]]
    np.testing.assert_array_equal(token_file.load(), expected)
    assert token_file.document_ends()[-1] == len(expected)


def test_processes_sharing_a_cache_tokenize_concurrently(tmp_path):
    """The processes of a job that share a cache folder may all tokenize at once: each ends
    with the same entry (atomic renames; one may remove the pieces under another)."""
    import subprocess
    import sys

    from tests.cli import ROOT

    texts = write_shards(tmp_path / "corpus")
    code = (
        "import sys; from spmd.io import shards; "
        f"f = shards.open_records({str(tmp_path / 'corpus')!r}, cache_dir={str(tmp_path / 'c')!r}, "
        "workers=1, say=lambda s: None); print(f.fingerprint)"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(set(outputs)) == 1
    token_file = shards.open_records(str(tmp_path / "corpus"), cache_dir=str(tmp_path / "c"))
    np.testing.assert_array_equal(token_file.load(), byte_tokens(texts))
    assert not list((tmp_path / "c").glob("shards-*")) and not list(
        (tmp_path / "c").glob("*partial*")
    )


CHATML = (  # a small ChatML-style template, written the way Hugging Face templates are
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chat_messages_rendered_by_the_template_count_assistant_turns_only(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from spmd.io import run_data
    from spmd.run.config import flat

    chats = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "And three plus three?"},
            {"role": "assistant", "content": "Six, of course."},
        ],
        [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}],
    ]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [m["content"] + " system user assistant\n" for chat in chats for m in chat]
    bpe.train_from_iterator(
        corpus * 20,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"})
    )
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": chats[0]}) + "\n")
    pq.write_table(pa.table({"messages": [chats[1]]}), tmp_path / "chats.parquet")
    train = flat(
        None,
        data=str(tmp_path / "chats.*"),
        tokenizer=str(folder / "tokenizer.json"),
        data_cache=str(tmp_path / "cache"),
        messages_field="messages",
        tokenize_workers=2,  # the pool: each worker compiles the template
    )
    token_file = run_data.open_token_file(train.data, train.data.data)
    ids, mask = token_file.load(), token_file.loss_mask()

    # Oracle, written out: ChatML text; counted = each assistant content and its end of turn.
    def chatml(m: dict) -> str:
        return f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"

    end = bpe.token_to_id("<|endoftext|>")
    expected_ids = [i for chat in chats for i in [*bpe.encode("".join(map(chatml, chat))).ids, end]]
    np.testing.assert_array_equal(ids, expected_ids)
    pieces = [bpe.decode([int(i)], skip_special_tokens=False) for i in ids]
    counted = "".join(p for p, m in zip(pieces, mask, strict=True) if m)
    not_counted = "".join(p for p, m in zip(pieces, mask, strict=True) if not m)
    assert counted == "Four.<|im_end|>\nSix, of course.<|im_end|>\n<|endoftext|>" + (
        "Hello!<|im_end|>\n<|endoftext|>"
    )
    assert "Four" not in not_counted and "two plus two" in not_counted

    # Bad records name the file and line; no template, or byte-level tokens, exit 2.
    bad = tmp_path / "bad.jsonl"
    lines = [chats[1], [{"content": "no role"}], [{"role": "tool", "content": "x"}] + chats[1]]
    bad.write_text("".join(json.dumps({"messages": m}) + "\n" for m in lines))
    fields = corpora.Fields(messages="messages")
    tokenizer, cache = str(folder / "tokenizer.json"), str(tmp_path / "cache")
    with pytest.raises(UsageError, match=rf"{bad} line 2 has a message 0 without a string 'ro"):
        shards.open_records(str(bad), tokenizer, cache, fields, workers=1)
    said = []
    shards.open_records(str(bad), tokenizer, cache, fields, 1, True, said.append)
    assert f"{bad} line 3: the chat template refuses it (unknown role tool)" in said[-1]
    with pytest.raises(UsageError, match="needs a chat template: pass --tokenizer"):
        shards.open_records(str(path), "", cache, fields, workers=1)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(UsageError, match="tokenizer_config.json has no chat_template"):
        shards.open_records(str(path), tokenizer, cache, fields, workers=1)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(UsageError, match="chat_template of .*tokenizer_config.json is not valid"):
        shards.open_records(str(path), tokenizer, cache, fields, workers=1)
