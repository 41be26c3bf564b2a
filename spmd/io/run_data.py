"""Open a training run's data from its flags: text files and token .bin files (spmd.io.tokens),
or record shards (spmd.io.corpora, tokenized by spmd.io.shards), cut into windows
(spmd.io.data) with the segment ids and loss weights the flags and the corpus call for."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from spmd.errors import UsageError
from spmd.io import corpora, data, fetch, formats, hf_datasets, mixture, pairs, shards, tokens
from spmd.log import say
from spmd.sections import DataConfig, choices

DOCUMENT_MASK = choices(DataConfig, "document_mask")


def check_choices(data_cfg: DataConfig) -> None:
    """UsageError for data flags that cannot work (before any device work)."""
    if data_cfg.document_mask not in DOCUMENT_MASK:
        raise UsageError(
            f"--document-mask {data_cfg.document_mask!r} is not one of {', '.join(DOCUMENT_MASK)}"
        )
    if data_cfg.tokenize_workers < 0:
        raise UsageError(
            f"--tokenize-workers {data_cfg.tokenize_workers} must be 0 (the machine's cores) or a "
            f"process count"
        )
    formats.check(data_cfg)


def fields_of(data_cfg: DataConfig, path: str = "") -> corpora.Fields:
    """The fields record corpus `path` is read by: the field flags', or --data-format's (told
    by its first record's fields under auto, and printed); without a path, the field flags'."""
    if not path:
        return formats.legacy_fields(data_cfg) or corpora.Fields()

    def first() -> tuple[str, list[str]]:
        return corpora.first_record_names(corpora.record_shards(path)[0])

    return formats.fields_for(data_cfg, first, say)


def source_path(data_cfg: DataConfig, path: str, flag: str = "--data") -> str:
    """`path` as read locally: a URL's local copy (spmd.io.fetch), a Hub dataset id's cached
    snapshot and split (spmd.io.hf_datasets)."""
    cache = Path(data_cfg.data_cache) if data_cfg.data_cache else tokens.default_cache_dir()
    path = fetch.local_copy(path, cache, flag) if path else path
    return hf_datasets.local(path, flag)


def open_token_file(
    data_cfg: DataConfig, path: str, flag: str = "--data", fields: corpora.Fields | None = None
) -> tokens.TokenFile:
    """The token file of one source (`path`: text, token .bin or record shards, read as
    `fields`, else as fields_of says); `flag` names the flag that gave it, for messages."""
    path = source_path(data_cfg, path, flag)
    if corpora.is_record_corpus(path):
        return shards.open_records(
            path,
            data_cfg.tokenizer,
            data_cfg.data_cache,
            fields or fields_of(data_cfg, path),
            data_cfg.tokenize_workers or os.cpu_count() or 1,
            data_cfg.skip_bad_records,
            say=say,
        )
    if path and not Path(path).exists():  # (before the fields: the path is the mistake)
        raise tokens.missing(path, flag)
    if data_cfg.data_format not in ("auto", "text"):
        raise UsageError(
            f"--data-format {data_cfg.data_format} needs JSONL / Parquet / Arrow records; --data "
            f"{path or '(the stdlib sources)'} is text or tokens"
        )
    named = data_cfg.prompt_field or data_cfg.messages_field or data_cfg.chosen_field
    if named:
        flag = next(
            f
            for f, v in (
                ("prompt", data_cfg.prompt_field),
                ("messages", data_cfg.messages_field),
                ("chosen", data_cfg.chosen_field),
            )
            if v
        )
        raise UsageError(
            f"--{flag}-field {named} needs JSONL / "
            f"Parquet / Arrow records; --data "
            f"{path or '(the stdlib sources)'} is text or tokens"
        )
    return tokens.open_tokens(path, data_cfg.tokenizer, data_cfg.data_cache, flag)


def windows_of(
    data_cfg: DataConfig,
    seq_len: int,
    token_file: tokens.TokenFile,
    eval_fraction: float,
    fields: corpora.Fields | None = None,
) -> data.TokenWindows | pairs.PairWindows:
    """The windows of a token file (read as `fields`, else the field flags') under the run's
    --document-mask (preference pairs: one padded row per document, spmd.io.pairs)."""
    ends = token_file.document_ends()
    if (fields or fields_of(data_cfg)).pairs:
        assert ends is not None  # pairs are read record by record (check_choices)
        mask = token_file.loss_mask()
        assert mask is not None  # a pair's documents are prompt/response ones
        return pairs.PairWindows(token_file.load(), ends, mask, seq_len, eval_fraction)
    masking = data_cfg.document_mask == "on" or (
        data_cfg.document_mask == "auto" and ends is not None
    )
    return data.TokenWindows(
        token_file.load(),
        seq_len,
        eval_fraction,
        document_ends=ends,
        loss_mask=token_file.loss_mask(),
        document_mask=masking,
    )


@dataclasses.dataclass(frozen=True)
class MixtureData:
    """What a checkpoint's data state records of a mixture (as of a TokenFile: .fingerprint)."""

    fingerprint: str
    source: str


def open_run_data(
    data_cfg: DataConfig, seq_len: int, batch: int, vocab_size: int
) -> tuple[Any, Any]:
    """(token file, train/eval windows) of --data, tokenized once and cached; for a mixture
    (name=path:weight,...) a MixtureData and a spmd.io.mixture.Mixture."""
    if not (mixture.is_mixture(data_cfg.data) and not Path(data_cfg.data).exists()):
        return open_source(data_cfg, seq_len, data_cfg.data, vocab_size, "data")
    pairs_named = fields_of(data_cfg).pairs or data_cfg.data_format == "preference"
    if pairs_named:  # a mixture draws rows one by one: pairs would split
        raise UsageError(
            f"--data {data_cfg.data}: preference pairs (--chosen-field) come from one source, "
            f"not a mixture, yet; give one source"
        )
    names, files, sources, weights = [], [], [], []
    for name, path, weight in mixture.parse_sources(data_cfg.data):
        token_file, windows = open_source(data_cfg, seq_len, path, vocab_size, f"data {name}")
        names.append(name)
        files.append(token_file)
        sources.append(windows)
        weights.append(weight)
    mix = mixture.Mixture(names, sources, weights, batch)
    say(f"mixture: {mix.describe()}")
    fingerprint = mixture.fingerprint(names, weights, [f.fingerprint for f in files])
    return MixtureData(fingerprint, data_cfg.data), mix


def open_eval_sets(
    data_cfg: DataConfig, seq_len: int, vocab_size: int, windows: Any
) -> dict[str, data.TokenWindows]:
    """The named eval sets: --eval-data (a path, named "eval", or name=path,...; all their
    windows are eval windows) and, for a mixture, each source's held-out windows."""
    sets = dict(windows.eval_sets()) if hasattr(windows, "eval_sets") else {}
    if not data_cfg.eval_data:
        return sets
    named = [("eval", data_cfg.eval_data, 1.0)]
    if mixture.is_mixture(data_cfg.eval_data) and not Path(data_cfg.eval_data).exists():
        named = mixture.parse_sources(data_cfg.eval_data, "--eval-data", weighted=False)
    for name, path, _ in named:
        fields = source_fields(data_cfg, path, "--eval-data")
        token_file = open_token_file(data_cfg, path, "--eval-data", fields)
        tokens.check_vocab(token_file, vocab_size)
        if name in sets:
            raise UsageError(f"--eval-data: the eval set name {name!r} is taken; rename it")
        sets[name] = windows_of(data_cfg, seq_len, token_file, 1.0, fields)
        if sets[name].fields != windows.fields:
            raise UsageError(
                f"--eval-data {path} gives batches of {'/'.join(sets[name].fields)}, the training "
                f"data {'/'.join(windows.fields)}; evaluate on data of the same kind"
            )
        say(f"eval set {name}: {token_file.source}, {sets[name].n_eval} windows")
    return sets


def first_source_fields(data_cfg: DataConfig) -> corpora.Fields | None:
    """The fields --data's (first) source is read by, told again without printing: what
    prompts outside the data (--sample-prompts) are rendered like; None for text or tokens."""
    path = data_cfg.data
    if mixture.is_mixture(path) and not Path(path).exists():
        path = mixture.parse_sources(path)[0][1]
    local = source_path(data_cfg, path)
    if not corpora.is_record_corpus(local):
        return None

    def first() -> tuple[str, list[str]]:
        return corpora.first_record_names(corpora.record_shards(local)[0])

    return formats.fields_for(data_cfg, first, lambda _line: None)


def source_fields(data_cfg: DataConfig, path: str, flag: str) -> corpora.Fields | None:
    """The fields of source `path` where it is a record corpus (told once, for both its token
    file and its windows), else None."""
    local = source_path(data_cfg, path, flag)
    return fields_of(data_cfg, local) if corpora.is_record_corpus(local) else None


def open_source(
    data_cfg: DataConfig, seq_len: int, path: str, vocab_size: int, label: str
) -> tuple[Any, Any]:
    """(token file, windows) of one source."""
    fields = source_fields(data_cfg, path, "--data")
    token_file = open_token_file(data_cfg, path, "--data", fields)
    tokens.check_vocab(token_file, vocab_size)
    windows = windows_of(data_cfg, seq_len, token_file, data_cfg.eval_fraction, fields)
    everything = fields is not None and fields.sft and fields.train_on_input
    extras = [
        name
        for name, on in (
            ("document mask", windows.document_mask),
            ("loss on responses only", windows.loss_mask is not None and not everything),
            ("loss on prompts and responses (--train-on-input)", everything),
        )
        if on
    ]
    say(
        f"{label}: {token_file.source}, {token_file.n_tokens / 1e6:.2f} M tokens "
        f"({token_file.path}), {windows.n_train} train / {windows.n_eval} eval windows of "
        f"{seq_len + 1}" + (f" | {', '.join(extras)}" if extras else "")
    )
    return token_file, windows
