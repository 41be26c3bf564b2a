"""Text <-> token ids for the commands that sample text (spmd.generate, the samples of
spmd.train): a Hugging Face tokenizer, or bytes."""

from __future__ import annotations

import dataclasses
from typing import Any

from spmd.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Codec:
    """Text <-> token ids: a Hugging Face tokenizer (read from `path`), or bytes (ids 0..255)."""

    tokenizer: Any  # tokenizers.Tokenizer or None
    path: str = ""  # its tokenizer.json

    def encode(self, text: str, specials: bool = True) -> list[int]:
        """`text`'s ids; `specials` False leaves out the tokens the tokenizer adds itself (a
        chat template writes its own)."""
        if self.tokenizer is None:  # the bytes given, UTF-8 or not (argv keeps others escaped)
            return list(text.encode("utf-8", "surrogateescape"))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UsageError(
                f"the prompt is not UTF-8 text (byte {e.start} of it); the tokenizer "
                f"{self.path} reads text: give the prompt in UTF-8"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=specials).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids)  # special tokens (the eos) left out
