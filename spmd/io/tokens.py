"""Token files: a corpus tokenized once, cached as a flat binary file of token ids, memory-mapped.

`--data` names a text file, a folder of text files, or a token `.bin` file (used as it is);
empty means the Python standard library's own sources (text every machine has). Text is
tokenized byte-level (vocabulary 256, nothing to load) or, with `--tokenizer PATH`, by a Hugging
Face `tokenizers` JSON file. The result is written once to the cache folder (`--data-cache`) as

    tokens-<key>.bin   token ids, uint16 (vocabulary <= 65536) or uint32, files separated by a
                       separator token (NUL for bytes; the tokenizer's end-of-text token if any)
    tokens-<key>.json  what it holds: dtype, token count, largest id, content fingerprint

where <key> hashes the source files' paths, sizes and modification times and the tokenizer's
content: editing a file or changing the tokenizer makes a new cache entry, and a second run
reads the memory map without tokenizing. The JSON is written last, so a crash mid-write leaves
no entry that looks complete. The fingerprint hashes the token ids themselves, so it identifies
the data a checkpoint was trained on wherever the cache lives.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from spmd.errors import UsageError

CACHE_FORMAT = 1  # bump when the token file layout or the tokenization changes
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".tex", ".json", ".csv", ".html", ".c", ".h")
TEXT_CHUNK_BYTES = 1 << 20  # tokenize this much text at a time (bounded memory)
SNIFF_BYTES = 1 << 16  # the start of each given text file that must read as UTF-8 text
END_OF_TEXT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def end_of_text_id(encoder: Any) -> int | None:
    """The id of `encoder`'s (a tokenizers.Tokenizer) first token of END_OF_TEXT_NAMES, or None
    when it has none of them."""
    ids = [encoder.token_to_id(name) for name in END_OF_TEXT_NAMES]
    return next((i for i in ids if i is not None), None)


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A flat file of token ids and what is known about it."""

    path: Path
    dtype: str  # "uint16" or "uint32"
    n_tokens: int
    max_id: int  # the largest token id in the file
    fingerprint: str  # hash of the token ids (hex)
    source: str  # for people: where the tokens came from

    def load(self) -> np.ndarray:
        """The token ids, memory-mapped read-only (pages are read on demand)."""
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))

    def document_ends(self) -> np.ndarray | None:
        """int64 end offset (exclusive, in tokens) of every document, where the corpus was
        read record by record (spmd.io.shards); None for text files and token .bin files."""
        docs = self.path.with_suffix(".docs")
        return np.fromfile(docs, np.int64) if docs.is_file() else None

    def loss_mask(self) -> np.ndarray | None:
        """uint8 per token, 1 where the loss counts it (prompt/response data); None without."""
        mask = self.path.with_suffix(".mask")
        if not mask.is_file():
            return None
        return np.memmap(mask, dtype=np.uint8, mode="r", shape=(self.n_tokens,))


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/spmd, else ~/.cache/spmd."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "spmd"


def stdlib_corpus() -> list[Path]:
    """The top-level modules of this Python's standard library (~4.7 MB of real text that
    every machine has without a download), in a fixed order."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def corpus_files(path: str, flag: str = "--data") -> list[Path]:
    """The text files of `path` (a file, or a folder searched recursively), sorted; `flag`
    (--data, --eval-data) names the flag in messages."""
    if not path:
        return stdlib_corpus()
    root = Path(path)
    if root.is_file():
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if files:
            return files
        raise UsageError(
            f"{flag} {path}: the folder holds no text files ({' '.join(TEXT_SUFFIXES)})"
        )
    raise missing(path, flag)


def missing(path: str, flag: str = "--data") -> UsageError:
    """The error for a `flag` (--data, --eval-data) path that does not exist: what the flag
    reads (a Hugging Face dataset id is resolved before this, spmd.io.hf_datasets)."""
    # a glob names no file itself: say that it matched none, not that it does not exist
    what = "matches no file" if any(c in path for c in "*?[") else "no such file or folder"
    return UsageError(
        f"{flag} {path}: {what}; {flag} reads local files (a text file or a "
        f"folder of them, a token .bin, JSONL / Parquet / Arrow records: a file, folder or "
        f"glob, a Hugging Face save_to_disk folder), a Hugging Face dataset id ORG/NAME[:SPLIT] "
        f"or a gs://, s3:// or other fsspec URL of them"
    )


def check_text(path: Path, flag: str = "--data") -> None:
    """UsageError unless the first SNIFF_BYTES of `path` read as text: UTF-8 without NUL bytes
    (byte-level training would otherwise learn a binary file's bytes without a word, and a
    tokenizer would replace what does not decode). Checked before the cache is looked up,
    so a cached entry of a binary file is refused too."""
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    nul = head.find(b"\0")
    where = nul
    if nul < 0:
        try:  # final=False: a character cut at the end of the sample is not an error
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as e:
            where = e.start
    if where >= 0:
        raise UsageError(
            f"{flag} {path} is not UTF-8 text (byte {where} is "
            f"{'NUL' if where == nul else 'not UTF-8'}); give text files, a token .bin or "
            f"JSONL / Parquet / Arrow records"
        )


def open_tokens(
    data: str, tokenizer: str = "", cache_dir: str = "", flag: str = "--data"
) -> TokenFile:
    """The token file for `--data` (tokenizing into the cache on first use); `flag` names the
    flag in messages (--eval-data reads its files here too)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if data.endswith(".bin") and Path(data).is_file():
        return _existing_token_file(Path(data), cache)
    files = corpus_files(data, flag)
    for file in files if data else ():  # the stdlib's sources are ours, not the user's
        check_text(file, flag)
    encoder = _load_tokenizer(tokenizer) if tokenizer else None
    sources = [(str(f.resolve()), *_stat(f)) for f in files]
    tokenizer_id = _file_hash(Path(tokenizer)) if tokenizer else "bytes"
    key = _hash_json({"format": CACHE_FORMAT, "files": sources, "tokenizer": tokenizer_id})
    what = f"{len(files)} file(s), " + (f"tokenizer {tokenizer}" if tokenizer else "byte-level")
    cached = _read_entry(cache / f"tokens-{key}.json", what)
    if cached is not None:
        return cached
    vocab = encoder.get_vocab_size(with_added_tokens=True) if encoder else 256
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    chunks = _token_chunks(files, encoder, dtype)
    return _write_entry(cache, key, chunks, dtype, what)


def check_vocab(tokens: TokenFile, vocab_size: int) -> None:
    """UsageError if the corpus uses token ids the model's embedding does not have."""
    if tokens.max_id >= vocab_size:
        raise UsageError(
            f"--vocab-size {vocab_size} is too small for the data ({tokens.source}), whose "
            f"token ids go up to {tokens.max_id}; pass --vocab-size {tokens.max_id + 1} or more"
        )


def _stat(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _hash_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]


def _file_hash(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise UsageError(f"--tokenizer {path}: cannot read it ({e.strerror})") from None


def _load_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(
            f"--tokenizer {path} needs the Hugging Face `tokenizers` package "
            f"(pip install tokenizers); leave --tokenizer out for byte-level tokens"
        ) from None
    if not Path(path).is_file():
        raise UsageError(f"--tokenizer {path}: no such file; give a tokenizer.json")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust library reports malformed files as plain Exceptions
        raise UsageError(f"--tokenizer {path} is not a tokenizers JSON file ({e})") from None


def _token_chunks(files: list[Path], encoder, dtype: str) -> Iterator[np.ndarray]:
    """Token ids of every file in order, each file followed by the separator token."""
    separator = 0 if encoder is None else end_of_text_id(encoder)
    for path in files:
        if encoder is None:
            with path.open("rb") as f:
                while block := f.read(TEXT_CHUNK_BYTES):
                    yield np.frombuffer(block, np.uint8).astype(dtype)
        else:
            for text in _text_blocks(path):
                yield np.asarray(encoder.encode(text).ids, dtype=dtype)
        if separator is not None:
            yield np.array([separator], dtype=dtype)


def _text_blocks(path: Path) -> Iterator[str]:
    """The file's text in blocks of about TEXT_CHUNK_BYTES that end at line ends, so that a
    tokenizer sees whole lines (subword merges never cross a block boundary mid-line)."""
    block: list[str] = []
    size = 0
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        for line in f:
            block.append(line)
            size += len(line)
            if size >= TEXT_CHUNK_BYTES:
                yield "".join(block)
                block, size = [], 0
    if block:
        yield "".join(block)


def _write_entry(
    cache: Path, key: str, chunks: Iterator[np.ndarray], dtype: str, source: str
) -> TokenFile:
    """Stream the chunks into tokens-<key>.bin, then write its JSON description."""
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"tokens-{key}.bin"
    partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
    digest = hashlib.blake2b(digest_size=16)
    n_tokens, max_id = 0, -1
    with partial.open("wb") as out:
        for chunk in chunks:
            if len(chunk):
                data = chunk.tobytes()
                out.write(data)
                digest.update(data)
                n_tokens += len(chunk)
                max_id = max(max_id, int(chunk.max()))
    if n_tokens == 0:
        partial.unlink()
        raise UsageError(f"--data ({source}) holds no text to train on")
    os.replace(partial, final)  # atomic: readers see the whole file or none
    fingerprint = digest.hexdigest()
    info = {"dtype": dtype, "n_tokens": n_tokens, "max_id": max_id, "fingerprint": fingerprint}
    _write_json(cache / f"tokens-{key}.json", {**info, "source": source})
    return TokenFile(final, dtype, n_tokens, max_id, fingerprint, source)


def _read_entry(description: Path, source: str) -> TokenFile | None:
    """The cached token file that `description` describes, or None if absent or stale."""
    try:
        info = json.loads(description.read_text())
        path = description.with_suffix(".bin")
        itemsize = np.dtype(info["dtype"]).itemsize
        if path.stat().st_size != info["n_tokens"] * itemsize:
            return None
        return TokenFile(
            path, info["dtype"], info["n_tokens"], info["max_id"], info["fingerprint"], source
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _existing_token_file(path: Path, cache: Path) -> TokenFile:
    """A token .bin given directly: uint16 ids unless a JSON beside it (same name, .json) says
    {"dtype": "uint32"}. Its count, largest id and fingerprint are computed once and cached."""
    beside = path.with_suffix(".json")
    dtype = "uint16"
    if beside.is_file():
        try:
            dtype = json.loads(beside.read_text()).get("dtype", dtype)
        except (ValueError, AttributeError):
            raise UsageError(f"--data {path}: {beside} is not a JSON object") from None
    if dtype not in ("uint16", "uint32"):
        raise UsageError(f"--data {path}: dtype {dtype!r} in {beside} is not uint16 or uint32")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise UsageError(
            f"--data {path}: {size} bytes is not a whole number of {dtype} token ids; give a "
            f"token file written as {dtype} (or text)"
        )
    key = _hash_json({"format": CACHE_FORMAT, "bin": [str(path.resolve()), *_stat(path)]})
    description = cache / f"tokens-{key}.json"
    source = f"token file {path}"
    try:
        info = json.loads(description.read_text())
        return TokenFile(path, dtype, size // itemsize, info["max_id"], info["fingerprint"], source)
    except (OSError, ValueError, KeyError):
        pass
    tokens = np.memmap(path, dtype=dtype, mode="r")
    digest = hashlib.blake2b(digest_size=16)
    max_id = 0
    for start in range(0, len(tokens), TEXT_CHUNK_BYTES):
        block = np.asarray(tokens[start : start + TEXT_CHUNK_BYTES])
        digest.update(block.tobytes())
        max_id = max(max_id, int(block.max()))
    cache.mkdir(parents=True, exist_ok=True)
    _write_json(description, {"max_id": max_id, "fingerprint": digest.hexdigest()})
    return TokenFile(path, dtype, len(tokens), max_id, digest.hexdigest(), source)


def _write_json(path: Path, value: dict) -> None:
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(value, indent=1))
    os.replace(partial, path)
