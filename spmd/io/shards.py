"""Tokenize record shards once, in parallel and resumably, into the token cache.

A pool of `--tokenize-workers` processes (default: the machine's cores) tokenizes one shard
each at a time into `shards-<key>/NNNNN.*` in the cache folder:

    NNNNN.tokens   the shard's token ids (dtype of the corpus), each document followed by the
                   end-of-text token (NUL for byte-level; the tokenizer's, if it has one)
    NNNNN.lengths  int64 length in tokens of each document (end-of-text token included)
    NNNNN.mask     uint8 per token, 1 where the loss counts it (SFT only: response + end token)
    NNNNN.json     written last: counts, largest id, skipped records; its presence = shard done

An interrupted run resumes from the shards whose JSON exists. When all are done they are joined
into the usual cache entry (spmd.io.tokens: `tokens-<key>.bin` + `.json`), plus
`tokens-<key>.docs` (int64 end offset of every document, for document-aware packing) and, for
SFT, `tokens-<key>.mask`; then the shard folder is removed. The key covers the shards' paths,
sizes and modification times, the field names, --skip-bad-records and the tokenizer's content.
Progress (shards, documents, tokens, tokens/s, ETA by bytes) is printed as shards finish.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import numpy as np

from spmd.errors import UsageError
from spmd.io import chat, corpora, tokens

ENCODE_BATCH = 256  # documents handed to the tokenizer at once (its batch encoder is faster)


def open_records(
    data: str,
    tokenizer: str = "",
    cache_dir: str = "",
    fields: corpora.Fields | None = None,
    workers: int = 0,
    skip_bad: bool = False,
    say=print,
) -> tokens.TokenFile:
    """The token file of the record shards `data` names, tokenizing what the cache lacks.
    `fields`: the record fields to read (default: the `text` field)."""
    fields = fields or corpora.Fields()
    fields.check()
    cache = Path(cache_dir) if cache_dir else tokens.default_cache_dir()
    shards = corpora.record_shards(data)
    tokenizer_id = tokens._file_hash(Path(tokenizer)) if tokenizer else "bytes"
    identity = {
        "format": tokens.CACHE_FORMAT,
        "records": [(str(s.resolve()), *tokens._stat(s)) for s in shards],
        "fields": [fields.text, fields.prompt, fields.response],
        **({"pairs": [fields.chosen, fields.rejected]} if fields.pairs else {}),
        **({"alpaca": list(fields.alpaca)} if fields.alpaca else {}),
        **(
            {"format": [fields.format, *fields.keys]}
            if fields.format or fields.keys != ("role", "content")
            else {}
        ),
        **({"train_on_input": True} if fields.train_on_input else {}),
        "skip_bad": skip_bad,
        "tokenizer": tokenizer_id,
    }
    if fields.chats:  # chats: the field and the template (its absence exits 2 here)
        flag = fields.chat_flag
        identity["chat"] = [fields.messages, chat.template_id(tokenizer, flag, fields.template)]
        chat.Renderer(tokenizer, flag, fields.template)  # compiles: a broken one exits 2 here
    key = tokens._hash_json(identity)
    what = f"{len(shards)} record shard(s) of {data}, fields {'/'.join(fields.names())}, " + (
        f"tokenizer {tokenizer}" if tokenizer else "byte-level"
    )
    cached = tokens._read_entry(cache / f"tokens-{key}.json", what)
    if cached is not None:
        return cached
    encoder = tokens._load_tokenizer(tokenizer) if tokenizer else None
    vocab = encoder.get_vocab_size(with_added_tokens=True) if encoder else 256
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    folder = cache / f"shards-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [
        (str(s), str(folder / f"{i:05d}"), fields, tokenizer, dtype, skip_bad)
        for i, s in enumerate(shards)
    ]
    try:
        infos = _run_pool(
            jobs, workers or os.cpu_count() or 1, [s.stat().st_size for s in shards], say
        )
        entry = _join(cache, key, [job[1] for job in jobs], infos, dtype, what, fields.sft)
    except OSError:
        # Another process of the job (same cache) finished the entry and removed the pieces
        # under this one: use its entry.
        theirs = tokens._read_entry(cache / f"tokens-{key}.json", what)
        if theirs is None:
            raise
        shutil.rmtree(folder, ignore_errors=True)  # what this process left there
        return theirs
    bad = sum(info["bad_records"] for info in infos)
    if bad:
        examples = [e for info in infos for e in info["bad_examples"]][:3]
        say(f"data: skipped {bad} bad record(s) (--skip-bad-records), e.g. {'; '.join(examples)}")
    shutil.rmtree(folder, ignore_errors=True)
    return entry


def _run_pool(jobs: list[tuple], workers: int, sizes: list[int], say) -> list[dict]:
    """Each job's shard JSON, tokenizing the shards not done yet (in a process pool when more
    than one worker and shard), printing progress."""
    infos: dict[int, dict] = {}
    todo = []
    for i, job in enumerate(jobs):
        done = _read_shard(Path(job[1]))
        if done is not None:
            infos[i] = done
        else:
            todo.append(i)
    if todo and len(infos):
        say(f"data: resuming tokenization, {len(infos)} of {len(jobs)} shards already done")
    total_bytes = sum(sizes[i] for i in todo)
    started, done_bytes, n_docs, n_tokens = time.perf_counter(), 0, 0, 0

    def progress(i: int, info: dict) -> None:
        nonlocal done_bytes, n_docs, n_tokens
        infos[i] = info
        done_bytes, n_docs, n_tokens = (
            done_bytes + sizes[i],
            n_docs + info["documents"],
            (n_tokens + info["n_tokens"]),
        )
        elapsed = time.perf_counter() - started
        eta = elapsed * (total_bytes - done_bytes) / max(done_bytes, 1)
        say(
            f"tokenized {len(infos)}/{len(jobs)} shards: {n_docs:,} documents, {n_tokens:,} "
            f"tokens, {n_tokens / max(elapsed, 1e-9):,.0f} tokens/s, ETA {eta:.0f} s"
        )

    workers = min(workers, len(todo))
    if workers <= 1:
        for i in todo:
            progress(i, tokenize_shard(*jobs[i]))
    else:
        # spawn, not fork: the parent may already run JAX's threads, which fork does not copy.
        context = multiprocessing.get_context("spawn")
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)
        try:
            futures = {pool.submit(tokenize_shard, *jobs[i]): i for i in todo}
            for future in concurrent.futures.as_completed(futures):
                progress(futures[future], future.result())
        finally:  # a bad shard or an interrupt: report it now, not after every queued shard
            pool.shutdown(wait=True, cancel_futures=True)
    return [infos[i] for i in range(len(jobs))]


_ENCODERS: dict[str, object] = {}  # per worker process: the tokenizer, loaded once
_RENDERERS: dict[tuple, chat.Renderer] = {}  # per worker process: the chat template, compiled once


def tokenize_shard(
    shard: str, prefix: str, fields: corpora.Fields, tokenizer: str, dtype: str, skip_bad: bool
) -> dict:
    """Tokenize one shard into `prefix`.tokens / .lengths / .mask, then `prefix`.json (last);
    returns what the JSON holds."""
    if tokenizer and tokenizer not in _ENCODERS:
        _ENCODERS[tokenizer] = tokens._load_tokenizer(tokenizer)
    encoder = _ENCODERS.get(tokenizer)
    separator = _separator(encoder)
    render = None
    if fields.chats:
        key = (tokenizer, fields.chat_flag, fields.template)
        if key not in _RENDERERS:
            _RENDERERS[key] = chat.Renderer(tokenizer, fields.chat_flag, fields.template)
        render = _RENDERERS[key]
    bad = corpora.BadRecords()
    pid = os.getpid()
    paths = {kind: Path(f"{prefix}.{kind}.partial-{pid}") for kind in ("tokens", "lengths", "mask")}
    max_id, n_tokens, lengths = -1, 0, []
    with paths["tokens"].open("wb") as out, paths["mask"].open("wb") as mask_out:
        pending: list[tuple] = []
        records = corpora.documents(Path(shard), fields, bad, skip_bad, render)
        for record in _then_none(records):
            if record is not None:
                pending.append(record)
            if pending and (record is None or len(pending) == ENCODE_BATCH):
                encode = _encode_chats if render else _encode
                for ids, mask in encode(pending, encoder, separator, fields, dtype):
                    out.write(ids.tobytes())
                    if fields.sft:
                        mask_out.write(mask.tobytes())
                    lengths.append(len(ids))
                    n_tokens += len(ids)
                    max_id = max(max_id, int(ids.max()))
                pending = []
    np.asarray(lengths, np.int64).tofile(paths["lengths"])
    for kind, path in paths.items():
        os.replace(path, f"{prefix}.{kind}")
    info = {
        "n_tokens": n_tokens,
        "documents": len(lengths),
        "max_id": max_id,
        "bad_records": bad.count,
        "bad_examples": bad.examples,
    }
    tokens._write_json(Path(f"{prefix}.json"), info)
    return info


def _then_none(iterator):
    yield from iterator
    yield None


def _separator(encoder) -> int | None:
    return 0 if encoder is None else tokens.end_of_text_id(encoder)


def _encode(
    records: list[tuple], encoder, separator: int | None, fields: corpora.Fields, dtype: str
):
    """(token ids, loss mask) of each record: its text (or prompt then response) and the end
    token. The mask is 1 on the response and the end token (the model learns to stop), and on
    the prompt too under --train-on-input."""
    end = np.asarray([] if separator is None else [separator], dtype)
    columns = list(zip(*records, strict=True))
    if encoder is None:  # bytes: numpy views of the UTF-8 encoding, no per-token Python work
        encoded = [[np.frombuffer(t.encode("utf-8"), np.uint8) for t in c] for c in columns]
    else:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets: ~2x faster here
        encode = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
        encoded = [[e.ids for e in encode(list(c))] for c in columns]
    for parts in zip(*encoded, strict=True):
        ids = np.concatenate([np.asarray(part, dtype) for part in parts] + [end])
        mask = None
        if fields.sft:
            mask = np.zeros(len(ids), np.uint8)
            mask[0 if fields.train_on_input else len(parts[0]) :] = 1
        if len(ids):
            yield ids, mask


def _encode_chats(
    records: list[tuple], encoder, separator: int | None, fields: corpora.Fields, dtype: str
):
    """(token ids, loss mask) of each rendered chat (text, assistant spans): the text tokenized
    whole, without the tokenizer's own special tokens (the template writes those), then the
    end token; the mask is 1 on the tokens that start in an assistant span and on the end
    token (on every token under --train-on-input)."""
    end = [] if separator is None else [separator]
    encoded = encoder.encode_batch([text for text, _ in records], add_special_tokens=False)
    for (_, spans), e in zip(records, encoded, strict=True):
        ids = np.asarray(e.ids + end, dtype)
        counted = [1] * len(e.ids) if fields.train_on_input else chat.counted(e.offsets, spans)
        mask = np.asarray(counted + [1] * len(end), np.uint8)
        if len(ids):
            yield ids, mask


def _read_shard(prefix: Path) -> dict | None:
    """The finished shard's JSON, or None if it is not finished (or its files do not match)."""

    try:
        info = json.loads(prefix.with_name(prefix.name + ".json").read_text())
        if prefix.with_name(prefix.name + ".lengths").stat().st_size != 8 * info["documents"]:
            return None
        return info
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _join(
    cache: Path, key: str, prefixes: list[str], infos: list[dict], dtype: str, what: str, sft: bool
) -> tokens.TokenFile:
    """Concatenate the shards (every one of `prefixes`, in order) into the cache entry
    (documents file and mask first, the token file and its JSON last, so an entry that looks
    complete is). A piece that is missing or short is an OSError, never a shorter entry."""
    if not any(info["n_tokens"] for info in infos):
        raise UsageError(f"--data ({what}) holds no text to train on")
    expected = sum(info["n_tokens"] for info in infos)
    # Open every piece before writing anything: an open file stays readable if another
    # process of the job removes it, and a piece already gone fails here, writing nothing.
    pieces = [
        np.memmap(f"{p}.tokens", dtype, "r")
        for p, i in zip(prefixes, infos, strict=True)
        if i["n_tokens"]
    ]
    masks = [open(f"{p}.mask", "rb") for p in prefixes] if sft else []  # noqa: SIM115
    lengths = np.concatenate([np.fromfile(f"{p}.lengths", np.int64) for p in prefixes])
    if sum(len(x) for x in pieces) != expected or lengths.sum() != expected:
        raise OSError(f"the tokenized shards of {what} are incomplete")
    pid = os.getpid()  # partial names per process, then atomic renames: readers see whole files
    docs = cache / f"tokens-{key}.docs.partial-{pid}"
    np.cumsum(lengths).tofile(docs)
    os.replace(docs, cache / f"tokens-{key}.docs")
    if sft:
        mask = cache / f"tokens-{key}.mask.partial-{pid}"
        with mask.open("wb") as out:
            for f in masks:
                with f:
                    shutil.copyfileobj(f, out)
        os.replace(mask, cache / f"tokens-{key}.mask")

    def chunks():
        for ids in pieces:
            for start in range(0, len(ids), tokens.TEXT_CHUNK_BYTES):
                yield np.asarray(ids[start : start + tokens.TEXT_CHUNK_BYTES])

    return tokens._write_entry(cache, key, chunks(), dtype, what)
