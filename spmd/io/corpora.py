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
from spmd.io import chat, hf_datasets
from spmd.io.formats import Fields

JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json")
ARROW_SUFFIXES = (".parquet", ".arrow")
RECORD_SUFFIXES = JSON_SUFFIXES + ARROW_SUFFIXES
ROWS_PER_BATCH = 1024  # Parquet / Arrow rows read at a time


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
    """Whether `--data` names record shards (a shard, a glob of them, a folder holding them, a
    Hugging Face `save_to_disk` folder or a folder's split) rather than text files or a token
    .bin."""
    if not data:
        return False
    if hf_datasets.split_files(data, RECORD_SUFFIXES) is not None:
        return True
    if glob.has_magic(data):
        return any(has_record_suffix(p) for p in glob.glob(data, recursive=True))
    root = Path(data)
    if root.is_dir():
        return any(p.is_file() and has_record_suffix(p.name) for p in root.rglob("*"))
    return has_record_suffix(data)


def record_shards(data: str) -> list[Path]:
    """The shards `data` names, sorted (the order is part of the corpus's identity); a Hugging
    Face dataset folder's in its own order (spmd.io.hf_datasets)."""
    layout = hf_datasets.split_files(data, RECORD_SUFFIXES)
    if layout is not None:
        return layout
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
    for index, name in enumerate(fields.names()):
        value = record.get(name)
        what = fields.problem(index, value)
        if what is not None:
            bad.add(f"{where} {what} {name!r} (fields: {', '.join(record) or 'none'})", skip)
            return None
        values.append(value)
    return fields.convert(tuple(values))


def _arrow_rows(path: Path, fields: Fields, bad: BadRecords, skip_bad: bool) -> Iterator[tuple]:
    names = fields.names()
    try:
        batches, schema = _record_batches(path, names)
    except UsageError:
        raise
    except Exception as e:  # pyarrow reports damaged files as several exception types
        raise UsageError(f"--data {path}: cannot read it as {path.suffix[1:]} ({e})") from None
    missing = [n for i, n in enumerate(names) if n not in schema.names and not fields.optional(i)]
    if missing:
        raise UsageError(
            f"--data {path} has no column {missing[0]!r} (columns: {', '.join(schema.names)}); "
            f"name the text column with --text-field (or --prompt-field / --response-field)"
        )
    row = 0
    try:
        for batch in batches:
            columns = [
                batch.column(n).to_pylist() if n in batch.schema.names else [None] * len(batch)
                for n in names
            ]
            for values in zip(*columns, strict=True):
                problems = [fields.problem(i, v) for i, v in enumerate(values)]
                if all(p is None for p in problems):
                    yield f"{path} row {row}", fields.convert(values)
                else:
                    i = next(i for i, p in enumerate(problems) if p is not None)
                    what = "has no string in" if not fields.chats else problems[i]
                    bad.add(f"{path} row {row} {what} column {names[i]!r}", skip_bad)
                row += 1
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"--data {path}: unreadable after row {row} ({e})") from None


def first_record_names(path: Path) -> tuple[str, list[str]]:
    """(where, the field names of the first record of shard `path`): a JSON line's keys, a
    Parquet or Arrow file's columns."""
    if path.name.endswith(JSON_SUFFIXES):
        opener = gzip.open if path.name.endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8", errors="strict") as f:
                for number, line in enumerate(f, start=1):
                    if line.strip():
                        record = json.loads(line)
                        where = f"{path} line {number}"
                        return where, list(record) if isinstance(record, dict) else []
        except (OSError, EOFError, ValueError) as e:
            raise UsageError(f"--data {path}: cannot read its first record ({e})") from None
        return str(path), []
    try:
        _, schema = _record_batches(path, ())
    except Exception as e:  # pyarrow reports damaged files as several exception types
        raise UsageError(f"--data {path}: cannot read it as {path.suffix[1:]} ({e})") from None
    return f"{path} (columns)", list(schema.names)


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
