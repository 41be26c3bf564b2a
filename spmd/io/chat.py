"""Chat records: a `messages` list of {role, content} rendered with the tokenizer's chat
template, the loss counting the assistant turns only.

The template is `--chat-template`'s (a built-in of spmd.io.templates, or a .jinja file), else
the `chat_template` of the `tokenizer_config.json` beside `--tokenizer`, or the
`chat_template.jinja` file there (Hugging Face's conventions, older and newer): Jinja,
rendered by jinja2 in a sandbox with the settings those templates are written for
(trim_blocks, lstrip_blocks, loop controls, a `raise_exception` function, a `strftime_now`
function, a `tojson` filter that writes plain JSON, the config's special tokens such as
`bos_token` and `eos_token` as variables). spmd.generate --chat renders a prompt with it too
(`Renderer.prompt`). A template's work is bounded: jinja2's sandbox refuses a `range` over
100,000 numbers, and here the ranges of one rendering may hold RANGE_BUDGET numbers together
and a `*` may repeat text or a list to MAX_REPEAT items; a template that breaks these, or
raises anything else, fails that record with a one-line reason (a bad record), never a
traceback.

Which tokens count. Each assistant message's text span is found by rendering prefixes of
the conversation: the messages before it with `add_generation_prompt=True` (everything up to
where the assistant starts writing) and the messages through it (its content and the
template's end-of-turn text). The span is the second rendering minus the first, and both must
be prefixes of the whole conversation's rendering (a template that renders a prefix
differently is a bad record). The whole rendering is then tokenized once, as the model will
see it, and a token counts when its first character lies in an assistant span: exact at the
character level, and a token that straddles a span's start is the template's, not the
assistant's.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from spmd.errors import UsageError
from spmd.io import templates

ASSISTANT = "assistant"
RANGE_BUDGET = 1_000_000  # numbers all of one rendering's ranges may yield together
MAX_REPEAT = 10_000_000  # items (characters, list entries) a `*` in a template may make


def config_path(tokenizer: str) -> Path:
    return Path(tokenizer).parent / "tokenizer_config.json"


def load_template(tokenizer: str, flag: str, override: str = "") -> tuple[str, dict[str, str]]:
    """(the chat template's source, the special tokens it may use) of `tokenizer`'s folder, or
    of `override` (a --chat-template value) with the folder's special tokens where it has a
    tokenizer_config.json; UsageError naming `flag` (the flag that wants it) where there is
    none."""
    if not tokenizer:
        raise UsageError(
            f"{flag} needs a chat template: pass --tokenizer with a tokenizer.json whose "
            f"folder's tokenizer_config.json has a chat_template, or --chat-template (byte-level "
            f"tokens have none)"
        )
    path = config_path(tokenizer)
    if override:
        config = _read_config(path) if path.is_file() else {}
        return templates.source(override), _specials(config)
    config = _read_config(path, f"{flag} needs {path} with a chat_template; cannot read it")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    # where transformers >= 4.43 saves it; transformers 5 reads it before the config's
    beside = path.parent / templates.EXPORTED_FILE
    if beside.is_file():
        template = beside.read_text(encoding="utf-8")
    if not isinstance(template, str) or not template:
        raise UsageError(
            f"{flag}: {path} has no chat_template (a Jinja string) and there is no {beside.name} "
            f"beside it; use a tokenizer that ships one, or give --chat-template "
            f"{' | '.join(templates.BUILTIN)} | FILE.jinja"
        )
    return template, _specials(config)


def _read_config(path: Path, why: str = "") -> dict:
    """tokenizer_config.json's object; UsageError (`why`, else naming the file) where it cannot
    be read."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{why or f'cannot read {path}'} ({e})") from None
    return config if isinstance(config, dict) else {}


def _specials(config: dict) -> dict[str, str]:
    """The config's `*_token` entries (bos_token, eos_token, ...) as strings."""
    specials = {}
    for key, value in config.items():
        if key.endswith("_token"):
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                specials[key] = value
    return specials


def template_id(tokenizer: str, flag: str, override: str = "") -> str:
    """A hash of what the rendering depends on (for the cache key)."""
    template, specials = load_template(tokenizer, flag, override)
    blob = json.dumps([template, specials], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class Renderer:
    """A compiled chat template: conversation -> (text, assistant character spans)."""

    def __init__(self, tokenizer: str, flag: str, override: str = ""):
        """The template of `tokenizer`'s folder, or `override` (a --chat-template value);
        `flag` (e.g. "--chat") names what wants it in the UsageError where it is missing or
        not valid Jinja."""
        try:
            import jinja2.sandbox
        except ImportError:
            raise UsageError(
                f"{flag} needs jinja2 for the chat template (pip install jinja2, or "
                f"spmd[tokenizer])"
            ) from None

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        source, self.specials = load_template(tokenizer, flag, override)
        env = _bounded_environment()(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.globals["range"] = self._range
        # jinja2's own tojson escapes <, >, & and ' for HTML; a prompt wants the JSON itself
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        self.range_left = RANGE_BUDGET
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            what = (
                f"--chat-template {override}"
                if override
                else f"the chat_template of {config_path(tokenizer)}"
            )
            raise UsageError(
                f"{flag}: {what} is not valid Jinja (line {e.lineno}: {e.message})"
            ) from None

    def _range(self, *args: int) -> range:
        """The sandbox's range (at most 100,000 numbers), charged to this rendering's budget."""
        import jinja2.sandbox

        numbers = jinja2.sandbox.safe_range(*args)
        self.range_left -= len(numbers)
        if self.range_left < 0:
            raise OverflowError(
                f"its ranges yield more than {RANGE_BUDGET:,} numbers in one rendering"
            )
        return numbers

    def _render(self, messages: list, generation_prompt: bool) -> str:
        """The template's text; ValueError saying why where it fails (whatever it raises: a
        template is the user's code, so its failure is theirs to read in one line)."""
        import jinja2

        self.range_left = RANGE_BUDGET
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=generation_prompt, **self.specials
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refuses it ({e})") from None
        except Exception as e:  # noqa: BLE001 (the template's own failure, whatever it is)
            raise ValueError(f"the chat template fails ({type(e).__name__}: {e})") from None

    def prompt(self, text: str) -> str:
        """`text` as one user message followed by the template's generation prompt (where the
        assistant starts writing); ValueError (saying why) where the template refuses it."""
        return self._render([{"role": "user", "content": text}], True)

    def __call__(self, messages: list) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and its assistant spans [start, end) in characters;
        ValueError (saying why) where the template refuses it or is not prefix-stable."""
        text = self._render(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            before = self._render(messages[:i], True)
            through = self._render(messages[: i + 1], False)
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"the chat template does not render message {i}'s prefix as a prefix "
                    f"of the conversation"
                )
            spans.append((len(before), len(through)))
        return text, spans


@functools.cache
def _bounded_environment() -> type:
    """jinja2's immutable sandbox with `*` and `**` bounded: text or a list repeated to at most
    MAX_REPEAT items, an integer raised to at most the 64th power (the sandbox itself bounds
    only ranges)."""
    import jinja2.sandbox

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                sized, times = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(sized, str | list | tuple) and isinstance(times, int):
                    if len(sized) * times > MAX_REPEAT:
                        raise OverflowError(f"a `*` makes more than {MAX_REPEAT:,} items")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 64:
                raise OverflowError(f"a `**` with exponent {right} (at most 64 here)")
            return super().call_binop(context, operator, left, right)

    return Bounded


def counted(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token (character offsets) whose first character is in an assistant span."""
    return [int(any(a <= start < b for a, b in spans)) for start, _ in offsets]
