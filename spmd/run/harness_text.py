"""lm-evaluation-harness's requests as token ids, tokenized as its Hugging Face backend (HFLM)
tokenizes them, so that spmd's numbers are those of `lm_eval --model hf` on the same model.

What decides the numbers, as lm-eval 0.4 does it:

- a (context, continuation) pair: the whitespace that ends the context belongs to the
  continuation; context + continuation is encoded whole and split after the context's own
  encoding (so a token that spans the boundary counts as the continuation's); an empty context
  is the prefix token (the tokenizer's BOS, else its EOS) unless the continuation starts with
  it, and the continuation is then encoded without special tokens;
- a scored row is the last max_length + 1 tokens of context + continuation, less the last one:
  the continuation's tokens are predicted from the positions before them;
- a rolling log-likelihood (perplexity) is the sum over disjoint windows of at most max_length
  predicted tokens, the first conditioned on the prefix token, each later one on the token
  before it, and the last one on a full window of context before it;
- generation stops at any `until` string or the EOS token's text, and the text is cut before
  the first stop string found.

No JAX here, and no lm_eval: the suite tests this without either.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from spmd.errors import UsageError
from spmd.io.tokens import end_of_text_id

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HFLM.max_gen_toks: a request naming none gets this


@dataclasses.dataclass(frozen=True)
class Text:
    """Text <-> ids with a Hugging Face `tokenizers.Tokenizer` (None: bytes, ids 0..255), and
    the two special tokens lm-eval's requests use: the prefix of an empty context and the end
    of text (its EOS, whose text also stops a generation)."""

    tokenizer: Any
    prefix_id: int
    eot_id: int

    def encode(self, text: str, specials: bool | None = None) -> list[int]:
        """`text`'s ids; `specials` None: the tokenizer's own special tokens unless the text
        starts with the prefix token's text already (HFLM.tok_encode's rule)."""
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        if specials is None:
            specials = not text.startswith(self.decode([self.prefix_id], skip_specials=False))
        return self.tokenizer.encode(text, add_special_tokens=specials).ids

    def decode(self, ids: list[int], skip_specials: bool = True) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_specials)

    @property
    def eot_text(self) -> str:
        return self.decode([self.eot_id], skip_specials=False)


def special_id(tokenizer: Any, value: Any) -> int | None:
    """The id of a tokenizer_config.json special token entry (a string, or an AddedToken's
    {"content": ...}), None when absent or unknown to the tokenizer."""
    if isinstance(value, dict):
        value = value.get("content")
    return tokenizer.token_to_id(value) if isinstance(value, str) else None


def text_of(tokenizer: Any, path: str = "") -> Text:
    """The Text of a tokenizer loaded from `path` (a tokenizer.json: the bos and eos tokens of
    the tokenizer_config.json beside it, as transformers reads them; without one, the corpus
    end-of-text token spmd separates documents with), or of bytes (tokenizer None: NUL, the
    byte-level corpora's separator, is both)."""
    if tokenizer is None:
        return Text(None, 0, 0)
    beside = Path(path).with_name("tokenizer_config.json")
    try:
        declared = json.loads(beside.read_text(encoding="utf-8")) if beside.is_file() else {}
    except (OSError, ValueError) as e:
        raise UsageError(f"{beside} is not a JSON file ({e}); give a tokenizer_config.json") from e
    declared = declared if isinstance(declared, dict) else {}
    bos = special_id(tokenizer, declared.get("bos_token"))
    eos = special_id(tokenizer, declared.get("eos_token"))
    eos = eos if eos is not None else end_of_text_id(tokenizer)
    if eos is None and bos is None:
        raise UsageError(
            f"the tokenizer {path} declares no bos_token or eos_token (tokenizer_config.json "
            f"beside it) and has no end-of-text token; lm-eval's requests need one"
        )
    prefix = bos if bos is not None else eos
    assert prefix is not None
    return Text(tokenizer, prefix, eos if eos is not None else prefix)


def pair_ids(text: Text, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a log-likelihood request."""
    if context == "":
        ids = text.encode(continuation, specials=False)
        if ids and ids[0] == text.prefix_id:
            return ids[:1], ids[1:]
        return [text.prefix_id], ids
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped) :] + continuation
    own = text.encode(context)  # the context's own ids, not the whole's first ones
    return own, text.encode(context + continuation)[len(own) :]


def rolling_windows(ids: list[int], prefix: int, max_length: int) -> list[tuple[list, list]]:
    """(context, continuation) windows whose continuations are `ids` in order, once each."""
    if not ids:
        return []
    first = min(max_length, len(ids))
    windows = [([prefix], ids[:first])]  # the prefix, then the first tokens predicted
    done = first
    while done < len(ids):
        count = min(len(ids) - done, max_length)
        end = done + count
        window = ids[end - max_length - 1 : end - 1]  # a full window of inputs ending at `end`
        windows.append((window[: len(window) - count + 1], ids[done:end]))
        done = end
    return windows


def scored_row(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """The whole row whose last len(continuation) targets are scored: the last max_length + 1
    tokens of context + continuation (the inputs are all but its last token, the targets all
    but its first). UsageError for a continuation longer than max_length."""
    if not continuation:
        raise UsageError(
            "a log-likelihood request has an empty continuation; lm-eval scores at least one "
            "token (check the task's doc_to_choice / doc_to_target)"
        )
    if len(continuation) > max_length:
        raise UsageError(
            f"a continuation of {len(continuation)} tokens is longer than --max-length "
            f"{max_length}; give a larger --max-length"
        )
    return (context + continuation)[-(max_length + 1) :]


@dataclasses.dataclass(frozen=True)
class Generation:
    """A generate_until request's settings: greedy unless do_sample with a temperature."""

    until: tuple[str, ...]
    max_gen_toks: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def generation(kwargs: dict[str, Any], eot_text: str, default: int) -> Generation:
    """The settings of a request's gen_kwargs as HFLM reads them: `until` (a string or a list)
    with the EOS text added, `max_gen_toks` (or max_new_tokens), sampling only with
    do_sample."""
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    if eot_text not in until:
        until.append(eot_text)
    count = kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", default))
    sampling = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0)) > 0
    if not sampling:
        return Generation(tuple(until), int(count))
    temperature = float(kwargs.get("temperature", 1.0))
    top_k, top_p = int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0)
    return Generation(tuple(until), int(count), temperature, top_k, top_p)


def cut(generated: str, until: tuple[str, ...]) -> str:
    """`generated` up to the first of the stop strings (empty ones ignored)."""
    for stop in until:
        if stop:
            generated = generated.split(stop)[0]
    return generated
