"""Samples while training: `--sample-every N --sample-prompts FILE` continues each prompt from
the current params every N steps, on the run's own mesh and shardings.

The sampler is the model alone on the training program's layout (spmd.run.builder's
`model_program`, the program spmd.generate builds on the same mesh) and spmd.generate's decoder
(spmd.run.decoding: a jitted prefill and decode loop with a key/value cache). It reads the
training state's params where they are: the master weights (`checkpoint_view`, the fp32 params
a checkpoint saves), whose shardings are those of the model program, so no second copy of the
weights is made; only the cache and the prompts' activations are new. It neither donates nor
changes the params, and draws from its own key (--seed), so the training trajectory is the
same with or without samples. Greedy by default (`--sample-temperature 0`).

FILE is text with one prompt per line (as spmd.generate's --prompts-file), or JSONL (a name
ending in .jsonl) of records with a "prompt" string, which may span lines. A chat run
(its records message lists: chat or sharegpt data) renders each prompt as a user message with
the run's chat template (--chat-template, else the tokenizer's) and its generation prompt,
as `spmd.generate --chat` does. Each row stops at the end-of-sequence ids spmd.generate would
stop at for the checkpoint the run saves.

Each sample goes to the run folder's samples.jsonl (`{"step", "prompt", "completion"}`, one
line a prompt, appended by a resumed run), one console line per prompt, and the trackers (a W&B
table, TensorBoard text, an MLflow text artifact: spmd.observe.trackers).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spmd.errors import UsageError
from spmd.log import is_primary, say
from spmd.run.codec import Codec
from spmd.sections import Config
from spmd.training import run_folder

if TYPE_CHECKING:
    from spmd.engine.step import Program

SAMPLES_FILE = run_folder.SAMPLES_FILE  # in the run folder
PROMPT_FIELD = "prompt"  # a JSONL prompts file's field


def check(cfg: Config, folder: str | None = "") -> None:
    """UsageError for sample flags that cannot work (before any device work): a missing or
    unreadable prompts file, --sample-every without prompts or prompts without it, settings
    out of range, a run without a run folder (`folder` None; "": not known yet), and what the
    sampler does not run under yet."""
    o = cfg.observe
    if o.sample_every < 0:
        raise UsageError(f"--sample-every {o.sample_every} must be a step count, or 0 (none)")
    if not o.sample_every:
        if o.sample_prompts:
            raise UsageError(
                f"--sample-prompts {o.sample_prompts} needs --sample-every N, the steps between "
                f"samples"
            )
        return
    if not o.sample_prompts:
        raise UsageError(
            f"--sample-every {o.sample_every} needs --sample-prompts FILE (one prompt per line, "
            f"or JSONL with a {PROMPT_FIELD!r} field)"
        )
    read_prompts(o.sample_prompts)
    if folder is None:
        raise UsageError(
            f"--sample-every {o.sample_every} writes {SAMPLES_FILE} into the run folder, and "
            f"this run has none; give --run-dir DIR"
        )
    if o.sample_max_new_tokens < 1:
        raise UsageError(f"--sample-max-new-tokens {o.sample_max_new_tokens} must be at least 1")
    if not 0 <= o.sample_temperature < math.inf:
        raise UsageError(
            f"--sample-temperature {o.sample_temperature} must be a finite number >= 0 (0: greedy)"
        )
    what = not_yet(cfg)
    if what:
        raise UsageError(
            f"--sample-every does not sample under {what} yet; sample from a checkpoint "
            f"with spmd.generate, or leave --sample-every out"
        )


def not_yet(cfg: Config) -> str:
    """What of a run the model alone cannot be fed the training params under yet (the
    samples and --eval-harness-every run the model program on them): "" where nothing."""
    p = cfg.parallel
    refused = [
        ("a pipeline (pp > 1)", _axis(p.mesh, ("pp", "pipeline"))),
        ("LoRA", cfg.lora.lora_rank > 0),
        ("--dcn-sync diloco", p.dcn_sync == "diloco"),
    ]
    return next((what for what, on in refused if on), "")


def _axis(mesh: str, names: tuple[str, ...]) -> bool:
    """Whether `mesh` ("dp=2,pp=2") gives one of the axis `names` a size other than 1."""
    for item in mesh.split(","):
        name, _, size = item.partition("=")
        if name.strip() in names and size.strip() not in ("1", ""):
            return True
    return False


def read_prompts(path: str) -> list[str]:
    """The prompts of FILE: its non-empty lines, or (.jsonl) each record's "prompt" string.
    UsageError naming the file (and line) for one that cannot be read or holds none."""
    flag = f"--sample-prompts {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"{flag}: {e.strerror or e}; give a text file of prompts") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} is not UTF-8 text (byte {e.start})") from None
    lines = text.splitlines()
    if not path.endswith(".jsonl"):
        prompts = [line for line in lines if line]
    else:
        prompts = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise UsageError(f"{flag}: line {number} is not JSON") from None
            value = record.get(PROMPT_FIELD) if isinstance(record, dict) else None
            if not isinstance(value, str) or not value:
                raise UsageError(
                    f"{flag}: line {number} has no non-empty string field {PROMPT_FIELD!r}"
                )
            prompts.append(value)
    if not prompts:
        raise UsageError(f"{flag} holds no prompt; give one per line")
    return prompts


class Sampler:
    """`sampler(step, state)`: sample every prompt from the training state's params, write
    the samples, and say them. Built once per run (its decoder compiles on first use)."""

    def __init__(
        self,
        cfg: Config,
        program: Program,
        model: Any,
        folder: str,
        log: Any,
        fields: Any = None,
    ) -> None:
        """`program`: the run's; `model`: the model alone on its layout (spmd.run.builder's
        model_program); `log`: the run's MetricsLog (its trackers); `fields`: the training
        data's (spmd.io.formats.Fields, as the data was read): a chat's are rendered."""
        from spmd import lora_base
        from spmd.io import eos
        from spmd.io.tokens import _load_tokenizer
        from spmd.run import decoding

        o = cfg.observe
        self.program, self.log = program, log
        self.texts = read_prompts(o.sample_prompts)
        tokenizer = cfg.data.tokenizer
        self.codec = Codec(_load_tokenizer(tokenizer), tokenizer) if tokenizer else Codec(None)
        self.prompts = encode(fields, self.texts, self.codec)
        vocab = cfg.model.vocab_size
        for i, ids in enumerate(self.prompts):
            if any(not 0 <= t < vocab for t in ids):
                raise UsageError(
                    f"--sample-prompts {o.sample_prompts}: prompt {i + 1} has a token id beyond "
                    f"the model's vocab of {vocab}; give text the run's tokenizer maps into it"
                )
        saved = lora_base.config_record(cfg)  # the config a checkpoint of this run records
        stops = eos.ids(saved.get(eos.KEY))
        if not stops and self.codec.tokenizer is not None:
            stops = eos.of_tokenizer(self.codec.path, self.codec.tokenizer)
        self.stops = tuple(stops)
        self.how = decoding.Sampling(o.sample_temperature)
        self.max_new_tokens, self.seed = o.sample_max_new_tokens, cfg.run.seed
        self.model = model
        self.path = str(Path(folder) / SAMPLES_FILE)

    def __call__(self, step: int, state: dict[str, Any]) -> None:
        import jax

        from spmd.run import decoding

        started = time.perf_counter()
        view = self.program.checkpoint_view(state)  # the master weights, or the optimizer's
        params = view.get("eval_params", view["params"])  # params to evaluate (schedule-free)
        shardings = jax.tree.map(lambda x: x.sharding, self.model.abstract_params)
        params = jax.device_put(params, shardings)  # where they already are: no copy
        completions = decoding.generate(
            self.model,
            params,
            self.prompts,
            self.max_new_tokens,
            self.how,
            self.seed,
            self.stops,
        )
        rows = [
            {"step": step, "prompt": text, "completion": self.codec.decode(ids)}
            for text, ids in zip(self.texts, completions, strict=True)
        ]
        if is_primary():
            with open(self.path, "a", encoding="utf-8") as file:
                file.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        self.log.track("samples", step=step, samples=rows)
        seconds = time.perf_counter() - started
        say(f"samples at step {step} ({seconds:.1f} s, {self.path}):")
        for row in rows:
            say(f"  {row['prompt']!r} -> {row['completion']!r}")


def encode(fields: Any, texts: list[str], codec: Codec) -> list[list[int]]:
    """The prompts' ids; a chat run's (its data `fields` are message lists, told by
    --data-format or the records) rendered as a user message and the generation prompt with
    the run's chat template (--chat-template, else the tokenizer's) first."""
    if fields is None or not fields.chats:
        return [codec.encode(text) for text in texts]
    from spmd.io import chat

    render = chat.Renderer(codec.path, "--sample-prompts", fields.template)
    rendered = []
    for i, text in enumerate(texts):
        try:
            rendered.append(render.prompt(text))
        except ValueError as e:
            raise UsageError(f"--sample-prompts: prompt {i + 1}: {e}") from None
    return [codec.encode(text, specials=False) for text in rendered]
