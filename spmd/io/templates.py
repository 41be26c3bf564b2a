"""Chat templates spmd knows by name, for `--chat-template chatml | llama3 | FILE.jinja`: a base
model's tokenizer often ships none, and a fine-tune needs one (or wants another).

Each is Jinja as Hugging Face chat templates are written (`messages`, `add_generation_prompt`),
rendered by spmd.io.chat like a tokenizer's own. The layouts are the published ones:

- chatml: each message `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`; the generation prompt
  `<|im_start|>assistant\\n`. No begin-of-text token.
- llama3: `<|begin_of_text|>`, then each message `<|start_header_id|>ROLE<|end_header_id|>\\n\\n`
  with its content stripped of surrounding whitespace (as Meta's template does) and
  `<|eot_id|>`; the generation prompt is the assistant's header.

The role and end tokens are written as text: a tokenizer that has them as special tokens (Qwen's
and Llama 3's do) encodes each as one id, another one spells them out in ordinary tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from spmd.errors import UsageError

CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
BUILTIN = {"chatml": CHATML, "llama3": LLAMA3}
FILE_SUFFIX = ".jinja"
SAVED_KEY = "chat_template_text"  # a checkpoint's saved config: the --chat-template's text
EXPORTED_FILE = "chat_template.jinja"  # where transformers 5 saves a tokenizer's template


def source(value: str, flag: str = "--chat-template") -> str:
    """The Jinja source `value` names: a built-in's, or a .jinja file's text; UsageError naming
    the value and what is valid otherwise."""
    if value in BUILTIN:
        return BUILTIN[value]
    if not value.endswith(FILE_SUFFIX):
        raise UsageError(
            f"{flag} {value!r} is not a template: give {', '.join(BUILTIN)} or a file "
            f"ending {FILE_SUFFIX}"
        )
    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {value}: cannot read it as a UTF-8 Jinja file ({e})") from None
    if not text.strip():
        raise UsageError(f"{flag} {value} is empty; give a Jinja chat template")
    return text


def digest(text: str) -> str:
    """A short hash of a template's text (how a resumed run knows it renders alike)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def adopted(saved_value: str, saved_text: str, cache: Path) -> str:
    """A --chat-template value that renders `saved_text` (a checkpoint's template, given as
    `saved_value`): that value where it still names the same text, else a copy of the text
    in the cache folder `cache` (named by its hash, so a run folder that moved resumes)."""
    try:
        if saved_value and source(saved_value) == saved_text:
            return saved_value
    except UsageError:  # a file that is gone or unreadable now: the saved text still is
        pass
    copy = cache / f"template-{digest(saved_text)}{FILE_SUFFIX}"
    if not copy.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = copy.with_name(f"{copy.name}.partial")
        partial.write_text(saved_text, encoding="utf-8")
        partial.replace(copy)
    return str(copy)
