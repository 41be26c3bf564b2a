"""The end-of-sequence token ids that spmd.generate stops at, as a model declares them.

A Hugging Face folder declares them in `generation_config.json`'s `eos_token_id` (one id or a
list: Llama 3 Instruct ends a turn with `<|eot_id|>` and a text with `<|end_of_text|>`), else
in `config.json`'s; `spmd.convert --from-hf --to` keeps them in the checkpoint it writes.
Otherwise they are the tokenizer's: the `eos_token` of the `tokenizer_config.json` beside
`tokenizer.json`, else the end-of-text token spmd separates documents with when it tokenizes
a corpus (tokens.END_OF_TEXT_NAMES), which a model trained here on that tokenizer learned to
write at a document's end. Byte-level text has none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spmd.io import chat, tokens

KEY = "eos_token_ids"  # where a converted checkpoint's config keeps them


def declared(folder: str) -> list[int]:
    """The eos ids of Hugging Face folder `folder`: generation_config.json's, else
    config.json's; [] where neither declares any."""
    for name in ("generation_config.json", "config.json"):
        try:
            raw = json.loads((Path(folder) / name).read_text())
        except (OSError, ValueError):  # absent or not JSON: the folder's reader says so
            continue
        found = ids(raw.get("eos_token_id") if isinstance(raw, dict) else None)
        if found:
            return found
    return []


def ids(value: Any) -> list[int]:
    """An `eos_token_id` value (an int, a list of ints or null) as a list of ids."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def of_tokenizer(path: str, encoder: Any) -> list[int]:
    """The eos id of tokenizer `encoder` (a tokenizers.Tokenizer read from `path`): its
    tokenizer_config.json's eos_token, else its end-of-text token; [] if it has neither."""
    try:
        config = json.loads(chat.config_path(path).read_text())
    except (OSError, ValueError):
        config = {}
    token = config.get("eos_token") if isinstance(config, dict) else None
    token = token.get("content") if isinstance(token, dict) else token
    found = encoder.token_to_id(token) if isinstance(token, str) else None
    found = tokens.end_of_text_id(encoder) if found is None else found
    return [] if found is None else [found]
