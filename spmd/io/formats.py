"""Dataset formats: what a record is, which of its fields make a document, and how it becomes
one (`--data-format`, `--data-fields`, `--train-on-input`).

    text        {"text": "..."}                                 the text, all of it counted
    chat        {"messages": [{"role": ..., "content": ...}]}   OpenAI style, the chat template
    sharegpt    {"conversations": [{"from": ..., "value": ...}]}    the same, its roles renamed
    alpaca      {"instruction": ..., "input": ..., "output": ...}   the Alpaca prompt + output
    preference  {"prompt": ..., "chosen": ..., "rejected": ...}     pairs (spmd.io.pairs)

`auto` (the default) tells the format from the first record's field names (a JSON line's keys,
a Parquet / Arrow file's columns): the one format whose fields are all there. None or several:
UsageError asking for --data-format. The older field flags (--prompt-field/--response-field,
--messages-field, --chosen-field/--rejected-field, a --text-field other than `text`) name the
fields themselves and keep working as before.

ShareGPT's `from` values are mapped to chat roles: human and user to user; gpt, assistant,
model, chatgpt and bing to assistant; system and tool stay. An alpaca record is the Stanford
Alpaca prompt (the variant with an Input section where `input` is not empty) as the prompt and
`output` as the response, so it trains the way Alpaca-style models were, with any tokenizer
(byte-level too), no chat template needed.

`--data-fields KEY=NAME,...` renames a format's fields (KEY from FORMAT_KEYS): `conversations=
dialog,from=speaker` reads ShareGPT records whose list is `dialog` and whose role is `speaker`.
`--train-on-input` makes the loss count the prompt's tokens too (chat: every token of the
rendering, the template's markers included; alpaca and prompt/response: the prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from spmd.errors import UsageError
from spmd.sections import DataConfig, choices

FORMATS = tuple(f for f in choices(DataConfig, "data_format") if f != "auto")
# each format's keys, which --data-fields may rename; a key's default name is itself
FORMAT_KEYS = {
    "text": ("text",),
    "chat": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
    "alpaca": ("instruction", "input", "output"),
    "preference": ("prompt", "chosen", "rejected"),
}
# the keys whose presence in a record tells its format (auto)
SIGNATURES = {
    "text": ("text",),
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "preference": ("chosen", "rejected"),
}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "tool": "tool",
}
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_INPUT_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ASSISTANT = "assistant"


@dataclasses.dataclass(frozen=True)
class Fields:
    """Which fields of a record hold the text and how they make a document: `text`,
    `prompt` + `response` (SFT), `messages` (a chat: a list of messages, rendered by
    spmd.io.chat), `chosen` + `rejected` (preference pairs), or `alpaca`'s three."""

    text: str = "text"
    prompt: str = ""
    response: str = ""
    messages: str = ""
    chosen: str = ""  # preference pairs: prompt + chosen, prompt + rejected
    rejected: str = ""
    alpaca: tuple[str, ...] = ()  # instruction, input (optional), output
    format: str = ""  # "sharegpt": the messages' roles are mapped (SHAREGPT_ROLES)
    keys: tuple[str, str] = ("role", "content")  # a message's role and content fields
    template: str = ""  # --chat-template (empty: the tokenizer's)
    train_on_input: bool = False  # the loss counts the prompt too

    @property
    def sft(self) -> bool:
        return bool(self.prompt or self.response or self.messages or self.pairs or self.alpaca)

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
        if self.template:
            return f"--chat-template {self.template}"
        return (
            f"--messages-field {self.messages}"
            if self.messages
            else f"--chosen-field {self.chosen}"
        )

    def names(self) -> tuple[str, ...]:
        if self.alpaca:
            return self.alpaca
        if self.messages:
            return (self.messages,)
        if self.pairs:
            return (
                (self.prompt, self.chosen, self.rejected)
                if self.prompt
                else (self.chosen, self.rejected)
            )
        return (self.prompt, self.response) if self.sft else (self.text,)

    def optional(self, index: int) -> bool:
        """Whether field `index` of names() may be missing (alpaca's input)."""
        return bool(self.alpaca) and index == 1

    def problem(self, index: int, value: object) -> str | None:
        """Why field `index`'s value is unusable ("has no field" style, before its name)."""
        if self.chats:
            roles = SHAREGPT_ROLES if self.format == "sharegpt" else None
            keys = self.keys if self.messages else ("role", "content")
            return conversation_problem(value, keys, roles)
        if isinstance(value, str) or (value is None and self.optional(index)):
            return None
        return "has no field" if value is None else "has a non-string"

    def convert(self, values: tuple) -> tuple:
        """A record's values as the readers downstream take them: messages as {role, content}
        lists, an alpaca record as (prompt, output)."""
        if self.alpaca:
            instruction, extra, output = values
            template = ALPACA_INPUT_PROMPT if extra else ALPACA_PROMPT
            return template.format(instruction=instruction, input=extra), output
        if self.messages and (self.format == "sharegpt" or self.keys != ("role", "content")):
            role, content = self.keys
            roles = SHAREGPT_ROLES if self.format == "sharegpt" else {}
            return (
                [{"role": roles.get(m[role], m[role]), "content": m[content]} for m in values[0]],
            )
        return values

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
            if self.train_on_input:
                raise UsageError(
                    "--train-on-input with preference pairs: the preference objectives compare "
                    "the responses only; leave it out"
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


def conversation_problem(
    value: object, keys: tuple[str, str], roles: dict[str, str] | None
) -> str | None:
    """Why `value` is not a usable conversation (messages with string `keys`, `roles` naming
    the known role values where they are mapped), or None."""
    role, content = keys
    if not isinstance(value, list) or not value:
        return "has no message list in"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get(role), str):
            return f"has a message {i} without a string {role!r} in"
        if not isinstance(message.get(content), str):
            return f"has a message {i} without a string {content!r} in"
        if roles is not None and message[role] not in roles:
            return (
                f"has a message {i} whose {role!r} is {message[role]!r} (not one of "
                f"{', '.join(roles)}) in"
            )
    mapped = [roles.get(m[role]) if roles else m[role] for m in value]
    if ASSISTANT not in mapped:
        return "has no assistant message in"
    return None


def field_map(text: str) -> dict[str, str]:
    """--data-fields KEY=NAME,... as a dict; UsageError for a malformed entry or a key that no
    format reads."""
    known = {key for keys in FORMAT_KEYS.values() for key in keys}
    mapping: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, name = part.partition("=")
        key, name = key.strip(), name.strip()
        if not name or key in mapping:
            raise UsageError(
                f"--data-fields {text!r}: {part!r} is not KEY=NAME (each key once), e.g. "
                f"conversations=dialog,from=speaker"
            )
        if key not in known:
            raise UsageError(
                f"--data-fields {text!r}: {key!r} is not a field key; the keys are "
                + "; ".join(f"{f}: {', '.join(k)}" for f, k in FORMAT_KEYS.items())
            )
        mapping[key] = name
    return mapping


def legacy_fields(cfg: DataConfig) -> Fields | None:
    """The Fields the older field flags name (--prompt-field, --messages-field, ...), or None
    when they are at their defaults."""
    named = (cfg.prompt_field, cfg.response_field, cfg.messages_field, cfg.chosen_field)
    if not any(named) and not cfg.rejected_field and cfg.text_field == "text":
        return None
    return Fields(
        cfg.text_field,
        cfg.prompt_field,
        cfg.response_field,
        cfg.messages_field,
        cfg.chosen_field,
        cfg.rejected_field,
        template=cfg.chat_template,
        train_on_input=cfg.train_on_input,
    )


def check(cfg: DataConfig) -> None:
    """UsageError for format flags that cannot work together (before any data is read)."""
    mapping = field_map(cfg.data_fields)
    legacy = legacy_fields(cfg)
    if legacy is not None:
        if mapping or cfg.data_format != "auto":
            given = f"--data-fields {cfg.data_fields}" if mapping else "--data-format"
            raise UsageError(
                f"{given} with the older field flags (--text-field, --prompt-field, "
                f"--messages-field, --chosen-field, ...): name the fields one way, e.g. "
                f"--data-format chat --data-fields messages=NAME"
            )
        legacy.check()
    elif cfg.data_format != "auto":
        unknown = sorted(set(mapping) - set(FORMAT_KEYS[cfg.data_format]))
        if unknown:
            raise UsageError(
                f"--data-fields: {unknown[0]!r} is not a field of --data-format "
                f"{cfg.data_format}; its keys are {', '.join(FORMAT_KEYS[cfg.data_format])}"
            )
        if cfg.data_format == "preference" and cfg.train_on_input:
            raise UsageError(
                "--train-on-input with preference pairs: the preference objectives compare "
                "the responses only; leave it out"
            )
    if cfg.chat_template:
        from spmd.io import templates

        templates.source(cfg.chat_template)  # a name or a readable file


def fields_for(cfg: DataConfig, first: Callable[[], tuple[str, list[str]]], say) -> Fields:
    """The Fields of a record corpus under `cfg`'s format flags; `first()` gives (where, the
    field names of the first record) when the format is to be told from them (auto, and
    preference: with a prompt field or as chat pairs). `say` prints the detected format."""
    legacy = legacy_fields(cfg)
    if legacy is not None:
        return legacy
    mapping = field_map(cfg.data_fields)
    names = {key: mapping.get(key, key) for keys in FORMAT_KEYS.values() for key in keys}
    names["text"] = mapping.get("text", cfg.text_field)
    fmt: str = cfg.data_format
    where, present = first() if fmt in ("auto", "preference") else ("", [])
    if fmt == "auto":
        fmt = detect(where, present, names)
        told = [names[k] for k in SIGNATURES[fmt]]
        say(f"data: format {fmt} (told by the fields {', '.join(told)} of {where})")
        unknown = sorted(set(mapping) - set(FORMAT_KEYS[fmt]))
        if unknown:
            raise UsageError(
                f"--data-fields: {unknown[0]!r} is not a field of the {fmt} format {where} has; "
                f"its keys are {', '.join(FORMAT_KEYS[fmt])} (or give --data-format)"
            )
    base = Fields(template=cfg.chat_template, train_on_input=cfg.train_on_input)
    if fmt == "text":
        return dataclasses.replace(base, text=names["text"])
    if fmt == "chat":
        keys = (names["role"], names["content"])
        return dataclasses.replace(base, messages=names["messages"], keys=keys)
    if fmt == "sharegpt":
        keys = (names["from"], names["value"])
        return dataclasses.replace(base, messages=names["conversations"], format=fmt, keys=keys)
    if fmt == "alpaca":
        alpaca = (names["instruction"], names["input"], names["output"])
        return dataclasses.replace(base, alpaca=alpaca, format=fmt)
    prompt = names["prompt"] if names["prompt"] in present else ""  # none: chat pairs
    fields = dataclasses.replace(
        base, prompt=prompt, chosen=names["chosen"], rejected=names["rejected"]
    )
    fields.check()
    return fields


def detect(where: str, present: list[str], names: dict[str, str]) -> str:
    """The one format whose signature fields are all in `present`; UsageError asking for
    --data-format where none or several are."""
    matches = [f for f, keys in SIGNATURES.items() if all(names[k] in present for k in keys)]
    if len(matches) == 1:
        return matches[0]
    fields = ", ".join(present) or "none"
    if not matches:
        raise UsageError(
            f"--data-format auto: the fields of {where} ({fields}) are none of the formats' "
            f"(text: text; chat: messages; sharegpt: conversations; alpaca: instruction, "
            f"output; preference: chosen, rejected); give --data-format and --data-fields"
        )
    raise UsageError(
        f"--data-format auto: the fields of {where} ({fields}) fit {' and '.join(matches)}; "
        f"give --data-format {' or '.join(matches)}"
    )
