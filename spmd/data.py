"""`python -m spmd.data preview|stats [data flags]`: look at what a run trains on.

    python -m spmd.data preview --data chats.jsonl --messages-field messages --tokenizer tok.json
    python -m spmd.data stats --data "web=a/*.parquet:0.7,code=b:0.3" --seq-len 2048

Both read the data as `spmd.train` would with the same flags (the data section, --seq-len,
--seed, and --batch for a mixture's rows per step), through the same reader and cache. No
model reads the tokens here, so any tokenizer's vocabulary goes, and a corpus too small for
a training batch still shows (spmd.train says what it lacks).

`preview` prints the first --windows windows that training reads, in order, decoded as text.
`¶` marks where a document starts (record corpora: JSONL, Parquet, Arrow; text files and token
.bin files have no known boundaries), and `«...»` wraps the tokens the loss does not count:
the prompt of prompt/response records, the chat template's roles and other turns, and each
window's first token (which nothing predicts). Everything else is a target of the loss.

`stats` prints, per source of a mixture: its tokens and documents, its windows (train / eval),
the share of tokens the loss counts, the longest document, and how many documents are longer
than a window (packing splits them across windows: no window sees them whole).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

from spmd.errors import UsageError, run_command
from spmd.run import config
from spmd.run.section_views import view
from spmd.sections import DataConfig, RunConfig

ACTIONS = ("preview", "stats")
DOCUMENT = "¶"  # a document starts here
OUT_OF_LOSS = ("«", "»")  # around the tokens the loss does not count
ANY_VOCAB = sys.maxsize  # no model reads the tokens here: every token id has an embedding


@dataclasses.dataclass(frozen=True)
class ShowConfig:
    """How much to show."""

    windows: int = 2  # preview: how many of the first windows training reads to print


def sections() -> dict[str, type]:
    run = view(RunConfig, ("batch", "seq_len", "seed"), "DataRun")
    return {"data": DataConfig, "run": run, "show": ShowConfig}


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    action = config.Positional("action", None, "preview (windows as text) or stats (counts)")
    resolved = config.resolve(
        argv, sections(), "python -m spmd.data", description=__doc__, positional=action
    )
    data_cfg, run_cfg, show = resolved["data"], resolved["run"], resolved["show"]
    if resolved["action"] not in ACTIONS:
        raise UsageError(f"{resolved['action']!r} is not an action; use {' or '.join(ACTIONS)}")
    if show.windows < 1:
        raise UsageError(f"--windows {show.windows} must be at least 1")
    if run_cfg.seq_len < 1 or run_cfg.batch < 1:
        raise UsageError(f"--seq-len {run_cfg.seq_len} and --batch {run_cfg.batch} must be >= 1")
    from spmd.io import hub, run_data

    run_data.check_choices(data_cfg)
    data_cfg = hub.resolve_section(data_cfg)  # a Hub id in --tokenizer: its cached file
    _, windows = run_data.open_run_data(data_cfg, run_cfg.seq_len, run_cfg.batch, ANY_VOCAB)
    sources = named_sources(windows)
    if resolved["action"] == "stats":
        for name, source in sources:
            print(source_stats(name, source, run_cfg.seq_len))
        return 0
    decode = decoder(data_cfg.tokenizer)
    print(
        f"legend: {DOCUMENT} a document starts; {OUT_OF_LOSS[0]}...{OUT_OF_LOSS[1]} not in the "
        f"loss; the rest are the loss's targets"
    )
    picked = first_windows(windows, run_cfg.seed, show.windows)
    for number, (name, source, window) in enumerate(picked):
        what = source.role(window) if hasattr(source, "role") else f"{name} window {window}"
        print(f"=== window {number + 1} ({what}) ===")
        print(render_window(source, window, decode))
    return 0


def named_sources(windows: Any) -> list[tuple[str, Any]]:
    """[(name, TokenWindows)]: a mixture's sources by name, else the one source as "data"."""
    if hasattr(windows, "sources"):
        return list(zip(windows.names, windows.sources, strict=True))
    return [("data", windows)]


def first_windows(windows: Any, seed: int, count: int) -> list[tuple[str, Any, int]]:
    """(source name, its TokenWindows, window id) of the first `count` windows training reads,
    in order. One source: its first epoch's order, whose consecutive slices are the steps'
    batches whatever --batch is (at most all its train windows); a mixture: the rows of steps
    1, 2, ... (its rows per source follow --batch)."""
    from spmd.io import data

    if hasattr(windows, "train_rows"):  # preference pairs: each chosen row, then its rejected
        return [("data", windows, int(i)) for i in windows.train_rows(seed, count)]
    if not hasattr(windows, "step_rows"):
        order = data.epoch_order(seed, 0, windows.n_train)[:count]
        return [("data", windows, int(i)) for i in order]
    picked: list[tuple[str, Any, int]] = []
    step = 0
    while len(picked) < count:
        sources, ids = windows.step_rows(seed, step)
        rows = zip(sources.tolist(), ids.tolist(), strict=True)
        picked += [(windows.names[s], windows.sources[s], i) for s, i in rows]
        step += 1
    return picked[:count]


def decoder(tokenizer: str) -> Any:
    """ids -> text: the tokenizer's (special tokens kept: the chat roles show), else bytes."""
    if not tokenizer:
        return lambda ids: bytes(ids).decode("utf-8", errors="replace")
    from spmd.io.tokens import _load_tokenizer

    path = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
    loaded = _load_tokenizer(str(path))
    return lambda ids: loaded.decode(ids, skip_special_tokens=False)


def token_roles(source: Any, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the window's seq_len + 1 token ids, whether each starts a document, whether the loss
    counts it as a target)."""
    ids = np.array([window])
    tokens = source.rows(ids)[0]
    counted = np.concatenate([[False], source.target_mask(ids)[0] > 0])  # token 0: no target
    starts = np.zeros(len(tokens), bool)
    if hasattr(source, "role"):  # a preference row: one sequence from its start
        starts[0] = True
    elif source.document_ends is not None:
        first = window * source.seq_len
        positions = first + np.arange(len(tokens))
        starts = np.isin(positions, np.concatenate([[0], source.document_ends]))
    return tokens, starts, counted


def render_window(source: Any, window: int, decode: Any) -> str:
    """The window as text: runs of tokens of one document and one loss state decoded
    together (a multi-byte character may span tokens), with the marks of the legend."""
    tokens, starts, counted = token_roles(source, window)
    pieces, run_start = [], 0
    for i in range(1, len(tokens) + 1):
        if i < len(tokens) and not starts[i] and counted[i] == counted[run_start]:
            continue
        text = decode(tokens[run_start:i].tolist())
        if not counted[run_start]:
            text = f"{OUT_OF_LOSS[0]}{text}{OUT_OF_LOSS[1]}"
        pieces.append((DOCUMENT if starts[run_start] else "") + text)
        run_start = i
    return "".join(pieces)


def source_stats(name: str, source: Any, seq_len: int) -> str:
    """One source's counts, one line each after a header line."""
    n_tokens = len(source.tokens)
    mask = source.loss_mask
    in_loss = 1.0 if mask is None else float(np.count_nonzero(mask)) / max(n_tokens, 1)
    lines = [
        f"{name}: {n_tokens:,} tokens",
        f"  windows: {source.n_train:,} train / {source.n_eval:,} eval of {seq_len + 1} tokens",
        f"  tokens in the loss: {in_loss:.1%}",
    ]
    ends = source.document_ends
    if ends is None:
        lines.append("  documents: not known (text or token files: no record boundaries)")
        return "\n".join(lines)
    lengths = np.diff(np.concatenate([[0], ends]))
    longest = int(lengths.max()) if len(lengths) else 0
    split = int(np.count_nonzero(lengths > seq_len + 1))
    if hasattr(source, "role"):  # preference pairs: one row per sequence, cut, never split
        return "\n".join(
            lines
            + [
                f"  preference pairs: {len(lengths) // 2:,}, longest sequence {longest:,} tokens",
                f"  longer than a row ({seq_len + 1} tokens), so cut at its end: {split:,}",
            ]
        )
    lines += [
        f"  documents: {len(lengths):,}, longest {longest:,} tokens",
        f"  longer than a window ({seq_len + 1} tokens), so split across windows: {split:,}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
