"""Record corpora: JSONL / Parquet / Arrow shards whose rows hold a text column, a prompt and
a response column (supervised fine-tuning), or a prompt, a chosen and a rejected response
column (preference pairs: read as two prompt/response documents each, chosen first).

`--data` names one shard, a folder of shards (searched recursively) or a glob pattern of them;
a shard is a `.jsonl`, `.jsonl.gz` or `.json` file of JSON lines (one object per line, read with
the standard library's json and gzip), or a `.parquet` or `.arrow` file (read with pyarrow, the
reference implementation of both formats: streaming by row group / record batch, so a shard of
many GB never sits in memory whole). Why not Hugging Face `datasets`: it would add a large
dependency tree and its own cache beside ours, for a reader the standard library already has.

A record that cannot be used (a line that is not JSON, a row without the field, a null or
non-string value) is a UsageError naming the file and the line (JSON lines, 1-based) or row
(Parquet/Arrow, 0-based); with `--skip-bad-records` it is counted (and the first few described)
instead, and the count is reported, never dropped silently. An unreadable shard is always an
error.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from spmd.errors import UsageError
from spmd.io import chat

JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json")
ARROW_SUFFIXES = (".parquet", ".arrow")
RECORD_SUFFIXES = JSON_SUFFIXES + ARROW_SUFFIXES
ROWS_PER_BATCH = 1024  # Parquet / Arrow rows read at a time


@dataclasses.dataclass(frozen=True)
class Fields:
    """Which fields of a record hold the text: `text`, `prompt` + `response` (SFT), or
    `messages` (a chat: a list of {role, content}, rendered by spmd.io.chat)."""

    text: str = "text"
    prompt: str = ""
    response: str = ""
    messages: str = ""
    chosen: str = ""  # preference pairs: prompt + chosen, prompt + rejected
    rejected: str = ""

    @property
    def sft(self) -> bool:
        return bool(self.prompt or self.response or self.messages or self.pairs)

    @property
    def pairs(self) -> bool:
        return bool(self.chosen or self.rejected)

    @property
    def chats(self) -> bool:
        """Whether the values are message lists (a chat, or chat pairs: pairs without a prompt
        field, whose shared leading messages are the prompt)."""
        return bool(self.messages or (self.pairs and not self.prompt))

    @property
    def chat_flag(self) -> str:
        """The flag that asks for the chat template, for messages."""
        return (
            f"--messages-field {self.messages}"
            if self.messages
            else f"--chosen-field {self.chosen}"
        )

    def names(self) -> tuple[str, ...]:
        if self.messages:
            return (self.messages,)
        if self.pairs:
            return (
                (self.prompt, self.chosen, self.rejected)
                if self.prompt
                else (self.chosen, self.rejected)
            )
        return (self.prompt, self.response) if self.sft else (self.text,)

    def problem(self, value: object) -> str | None:
        """Why a field's value is unusable ("has no field" style, before the field's name)."""
        if self.chats:
            return chat.message_problem(value)
        if isinstance(value, str):
            return None
        return "has no field" if value is None else "has a non-string"

    def check(self) -> None:
        """UsageError unless both or neither of prompt and response are named, and messages
        only without them; pairs name prompt, chosen and rejected, and no response."""
        if self.pairs:
            if not (self.chosen and self.rejected) or self.response or self.messages:
                raise UsageError(
                    f"--chosen-field {self.chosen!r} / --rejected-field {self.rejected!r}: "
                    f"preference pairs need both (with --prompt-field for text, without it "
                    f"for message lists), and no --response-field or --messages-field"
                )
            return
        if self.messages and (self.prompt or self.response):
            raise UsageError(
                f"--messages-field {self.messages} reads chats; leave out --prompt-field and "
                f"--response-field, or --messages-field"
            )
        if bool(self.prompt) != bool(self.response):
            raise UsageError(
                f"--prompt-field {self.prompt!r} and --response-field {self.response!r}: give "
                f"both (supervised fine-tuning) or neither (--text-field {self.text!r})"
            )


@dataclasses.dataclass
class BadRecords:
    """Records skipped under --skip-bad-records: how many, and the first few, described."""

    count: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)

    def add(self, where: str, skip: bool) -> None:
        if not skip:
            raise UsageError(f"--data {where}; fix it or pass --skip-bad-records")
        self.count += 1
        if len(self.examples) < 3:
            self.examples.append(where)


def has_record_suffix(path: str) -> bool:
    return path.endswith(RECORD_SUFFIXES)


def is_record_corpus(data: str) -> bool:
    """Whether `--data` names record shards (a shard, a glob of them, a folder holding them)
    rather than text files or a token .bin."""
    if not data:
        return False
    if glob.has_magic(data):
        return any(has_record_suffix(p) for p in glob.glob(data, recursive=True))
    root = Path(data)
    if root.is_dir():
        return any(p.is_file() and has_record_suffix(p.name) for p in root.rglob("*"))
    return has_record_suffix(data)


def record_shards(data: str) -> list[Path]:
    """The shards `data` names, sorted (the order is part of the corpus's identity)."""
    if glob.has_magic(data):
        found = [Path(p) for p in glob.glob(data, recursive=True)]
    elif Path(data).is_dir():
        found = list(Path(data).rglob("*"))
    elif Path(data).is_file():
        found = [Path(data)]
    else:
        raise UsageError(f"--data {data}: no such file, folder or matching pattern")
    shards = sorted(p for p in found if p.is_file() and has_record_suffix(p.name))
    if not shards:
        raise UsageError(f"--data {data}: no record shards there ({' '.join(RECORD_SUFFIXES)})")
    return shards


def documents(
    path: Path, fields: Fields, bad: BadRecords, skip_bad: bool, render=None
) -> Iterator[tuple]:
    """The shard's records in order: (text,) or (prompt, response) strings per record; for
    chats `render(messages)` of each record (a ValueError from it is a bad record)."""
    if path.name.endswith(JSON_SUFFIXES):
        records = _json_lines(path, fields, bad, skip_bad)
    else:
        records = _arrow_rows(path, fields, bad, skip_bad)
    for where, values in records:
        if fields.pairs:  # two SFT documents, chosen then rejected: spmd.io.pairs pairs them
            try:
                yield from pair_documents(values, render)
            except ValueError as e:
                bad.add(f"{where}: {e}", skip_bad)
            continue
        if render is None:
            yield values
            continue
        try:
            yield render(*values)
        except ValueError as e:
            bad.add(f"{where}: {e}", skip_bad)


def pair_documents(values: tuple, render=None) -> tuple[tuple, tuple]:
    """A preference record's two documents, chosen then rejected: (prompt, response) texts, or
    for chat pairs (`render`: the chat template) each conversation rendered, (text, spans)
    with only the spans of the assistant messages after the shared prompt (the leading
    messages the two have in common). ValueError saying why a record is unusable (both made
    before either is returned, so a bad record never leaves half a pair)."""
    if render is None:
        prompt, chosen, rejected = values
        if not (chosen and rejected):
            raise ValueError("has an empty chosen or rejected response")
        return (prompt, chosen), (prompt, rejected)
    chosen, rejected = values
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ValueError("its chosen and rejected conversations share no first message (prompt)")
    documents = []
    for messages in (chosen, rejected):
        if not any(m["role"] == chat.ASSISTANT for m in messages[shared:]):
            raise ValueError("a conversation has no assistant message after the shared prompt")
        text, spans = render(messages)
        skip = sum(m["role"] == chat.ASSISTANT for m in messages[:shared])
        documents.append((text, spans[skip:]))
    return documents[0], documents[1]


def _json_lines(path: Path, fields: Fields, bad: BadRecords, skip_bad: bool) -> Iterator[tuple]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="strict") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    record = json.loads(line)
                except ValueError:
                    bad.add(f"{where} is not a JSON object", skip_bad)
                    continue
                values = _values(record, fields, where, bad, skip_bad)
                if values is not None:
                    yield where, values
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise UsageError(f"--data {path}: cannot read it as UTF-8 JSON lines ({e})") from None


def _values(record: object, fields: Fields, where: str, bad: BadRecords, skip: bool):
    if not isinstance(record, dict):
        bad.add(f"{where} is not a JSON object", skip)
        return None
    values = []
    for name in fields.names():
        value = record.get(name)
        what = fields.problem(value)
        if what is not None:
            bad.add(f"{where} {what} {name!r} (fields: {', '.join(record) or 'none'})", skip)
            return None
        values.append(value)
    return tuple(values)


def _arrow_rows(path: Path, fields: Fields, bad: BadRecords, skip_bad: bool) -> Iterator[tuple]:
    names = fields.names()
    try:
        batches, schema = _record_batches(path, names)
    except UsageError:
        raise
    except Exception as e:  # pyarrow reports damaged files as several exception types
        raise UsageError(f"--data {path}: cannot read it as {path.suffix[1:]} ({e})") from None
    missing = [n for n in names if n not in schema.names]
    if missing:
        raise UsageError(
            f"--data {path} has no column {missing[0]!r} (columns: {', '.join(schema.names)}); "
            f"name the text column with --text-field (or --prompt-field / --response-field)"
        )
    row = 0
    try:
        for batch in batches:
            columns = [batch.column(batch.schema.get_field_index(n)).to_pylist() for n in names]
            for values in zip(*columns, strict=True):
                problems = [fields.problem(v) for v in values]
                if all(p is None for p in problems):
                    yield f"{path} row {row}", values
                else:
                    i = next(i for i, p in enumerate(problems) if p is not None)
                    what = "has no string in" if not fields.chats else problems[i]
                    bad.add(f"{path} row {row} {what} column {names[i]!r}", skip_bad)
                row += 1
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"--data {path}: unreadable after row {row} ({e})") from None


def _record_batches(path: Path, names: tuple[str, ...]):
    """(an iterator of pyarrow RecordBatches holding the needed columns, the file's schema)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        present = [n for n in names if n in schema.names]
        return parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=present), schema
    source = pa.memory_map(str(path))
    try:  # the Arrow IPC file format (random access) ...
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        return batches, reader.schema
    except pa.ArrowInvalid:  # ... or the stream format (what Hugging Face datasets saves)
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        return iter(reader), reader.schema
