"""`python -m spmd.generate`: sample text from a checkpoint with a key/value cache, on any mesh.

    python -m spmd.generate --checkpoint runs/ckpt --prompt "def " --max-new-tokens 200
    python -m spmd.generate --from-hf meta-llama/Llama-3.2-1B-Instruct --chat --prompt "Hi"
    python -m spmd.generate --from-hf path/to/hf_llama --prompts-file prompts.txt --top-p 0.9

The params come from an spmd checkpoint folder (a training run's `--checkpoint-dir`, or the
`--to` folder of spmd.convert) or a Hugging Face folder or Hub id, read straight into the
param shardings of `--mesh`. Text is byte-level unless a tokenizer is given or the checkpoint
was trained with one (`--tokenizer` in its config; `tokenizer.json` in a Hugging Face folder).

All prompts (`--prompt`, or one per line of `--prompts-file`, each `--num-samples` times) form
one batch (spmd/run/decoding.py: right-padded, each row at its own positions). Each row stops at
the model's end-of-sequence ids (spmd/io/eos.py) unless `--ignore-eos`. `--chat` renders each
prompt as a user message with the chat template: the one a checkpoint was trained with
(`--chat-template`, saved in it), else the tokenizer's. A single prompt's text is printed
as it is sampled (`--stream`); a batch's at the end. stdout holds the text only; the closing
line of counts and tokens/s goes to stderr.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from spmd.errors import UsageError, run_command
from spmd.io import chat, eos, hub, run_paths, templates
from spmd.io.tokens import _load_tokenizer, default_cache_dir
from spmd.run import config, decoding
from spmd.run.codec import Codec
from spmd.run.decoding import Sampling, generate
from spmd.sections import MeshConfig, flat_values


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """What to sample from and how. Lengths are in tokens."""

    checkpoint: str = ""  # spmd checkpoint folder (a run's --checkpoint-dir or convert's --to)
    step: int = 0  # checkpoint step to read (0: the newest)
    from_hf: str = ""  # a Hugging Face folder or Hub id (org/name) instead of --checkpoint
    prompt: str = ""  # the text to continue
    prompts_file: str = ""  # or: one prompt per line
    num_samples: int = 1  # samples per prompt
    chat: bool = False  # render each prompt as a user message with the tokenizer's chat template
    max_new_tokens: int = 200  # most tokens sampled after each prompt
    ignore_eos: bool = False  # sample all --max-new-tokens, past the end-of-sequence ids
    temperature: float = 0.8  # softmax temperature; 0 is greedy
    top_k: int = 0  # sample among the k likeliest tokens (0: all)
    top_p: float = 1.0  # sample among the likeliest tokens holding this probability (1: all)
    seed: int = 0  # of the sampling
    stream: bool = True  # print a single prompt's text as it is sampled (a batch: at the end)
    tokenizer: str = ""  # tokenizer.json, its folder or a Hub id (empty: the checkpoint's)
    # the folder of a LoRA checkpoint's base when it is no longer where the checkpoint recorded
    # it (moved, or another copy): its content hash must match (empty: the recorded folder)
    lora_base: str = ""

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)


CACHE_ITEMSIZE = 4  # bytes per cached key or value: generation runs the fp32 policy


def check_length(cfg: GenerateConfig, prompts: list[list[int]], source: Any, layout: Any) -> None:
    """UsageError when the prompts plus --max-new-tokens pass the positions the source declares
    (config.json's max_position_embeddings; int32's otherwise), or when the key/value cache and
    params cannot fit the mesh's devices even spread evenly over all of them (checked before
    anything is allocated)."""
    import jax

    from models import family
    from spmd.estimate.units import binary
    from spmd.observe.capacity import device_capacity

    longest = max(len(p) for p in prompts)
    total, limit = longest + cfg.max_new_tokens, source.max_positions or decoding.POSITION_LIMIT
    if total > limit:
        declared = source.where if source.max_positions else "int32 positions"
        raise UsageError(
            f"--max-new-tokens {cfg.max_new_tokens} after a prompt of {longest} tokens makes "
            f"{total} positions, beyond the model's {limit} ({declared}); give --max-new-tokens "
            f"{limit - longest} or less" + (" and a shorter prompt" if limit <= longest else "")
        )
    model, mesh = source.model, layout.mesh
    rows = len(prompts) + (-len(prompts) % layout.data_parallel)  # padded to the dp size
    kv = model.n_layers * rows * total * model.n_kv_heads * model.head_dim
    cache = 2 * kv * CACHE_ITEMSIZE
    need = (cache + CACHE_ITEMSIZE * family.of(model).n_params(model)) / mesh.size
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    capacity = device_capacity(local)
    if capacity is not None and need > capacity.bytes:
        raise UsageError(
            f"--max-new-tokens {cfg.max_new_tokens}: the key/value cache of {rows} rows x "
            f"{total} positions and the params need at least {binary(need)} per device "
            f"(spread over all {mesh.size}) but a device holds {binary(capacity.bytes)} "
            f"({capacity.source}); give fewer --max-new-tokens or prompts, or more devices"
        )


# --- text -----------------------------------------------------------------------------------


def codec_for(cfg: GenerateConfig, run_config: dict[str, Any], vocab: int) -> Codec:
    """--tokenizer, else the tokenizer the checkpoint was trained or converted with, else a
    Hugging Face folder's tokenizer.json; bytes if none."""

    recorded = run_paths.tokenizer_file(cfg.checkpoint, run_config) if cfg.checkpoint else None
    named = run_paths.tokenizer_named(run_config)  # trained with; converted with
    if not cfg.tokenizer and recorded is None and named:
        raise UsageError(
            f"--checkpoint {cfg.checkpoint} names the tokenizer {named}, which is "
            f"not there any more; give it with --tokenizer PATH"
        )
    path = cfg.tokenizer or (str(recorded) if recorded is not None else "")
    beside = Path(cfg.from_hf) / "tokenizer.json" if cfg.from_hf else None
    if not path and beside is not None and beside.is_file():
        path = str(beside)
    if path:
        return Codec(_load_tokenizer(path), path)
    if vocab > 256:
        raise UsageError(
            f"the model's vocab {vocab} is not byte-level (256) and no tokenizer is known; "
            f"give --tokenizer PATH (a tokenizer.json, its folder or a Hub id)"
        )
    return Codec(None)


def stop_ids(cfg: GenerateConfig, run_config: dict[str, Any], codec: Codec) -> tuple[int, ...]:
    """The end-of-sequence ids generation stops at (see spmd/io/eos.py); none with
    --ignore-eos."""
    if cfg.ignore_eos:
        return ()
    found = eos.declared(cfg.from_hf) if cfg.from_hf else eos.ids(run_config.get(eos.KEY))
    if not found and codec.tokenizer is not None:
        found = eos.of_tokenizer(codec.path, codec.tokenizer)
    return tuple(found)


def shown(text: str) -> str:
    """`text` as it can be printed: bytes that are not UTF-8 (kept escaped from the command
    line) as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def check_vocab(prompts: list[list[int]], vocab: int) -> None:
    """UsageError for a prompt token id the model has no embedding for (a byte above a
    byte-level model's vocab)."""
    for i, ids in enumerate(prompts):
        beyond = [t for t in ids if not 0 <= t < vocab]
        if beyond:
            raise UsageError(
                f"prompt {i + 1} has token id {beyond[0]}, beyond the model's vocab of {vocab}; "
                f"give text the model's tokenizer maps into it"
            )


def encode_prompts(
    cfg: GenerateConfig, texts: list[str], codec: Codec, run_config: dict[str, Any] | None = None
) -> list[list[int]]:
    """The prompts' token ids; with --chat, each rendered first as a user message and the
    template's generation prompt: the checkpoint's --chat-template where it was trained with
    one (its text saved in `run_config`), else the tokenizer's (UsageError where there is
    none)."""
    if not cfg.chat:
        return [codec.encode(text) for text in texts]

    if codec.tokenizer is None:  # byte-level text has no template
        chat.load_template("", "--chat")
    saved = (run_config or {}).get(templates.SAVED_KEY)
    override = ""
    if isinstance(saved, str) and run_config:
        named = str(flat_values(run_config).get("chat_template", ""))
        override = templates.adopted(named, saved, default_cache_dir())
    render = chat.Renderer(codec.path, "--chat", override)
    rendered = []
    for i, text in enumerate(texts):
        try:
            rendered.append(render.prompt(text))
        except ValueError as e:
            raise UsageError(f"--chat: prompt {i + 1}: {e}") from None
    return [codec.encode(text, specials=False) for text in rendered]


class Stream:
    """Prints one row's text as its tokens come. Each print is the text the new tokens add to
    the few before them (decoded together, as a tokenizer may join or space them), held back
    while it ends in a partial character (decoded as U+FFFD); so the work per token stays
    constant however long the text."""

    def __init__(self, codec: Codec):
        self.codec, self.context, self.shown = codec, 0, 0
        self.ids: list[int] = []

    def __call__(self, new: list[list[int]], last: bool = False) -> None:
        """Print what `new` (the row's next ids) adds; with `last`, all of it and a newline."""
        self.ids.extend(new[0])
        before = self.codec.decode(self.ids[self.context : self.shown])
        after = self.codec.decode(self.ids[self.context :])
        if last or (len(after) > len(before) and not after.endswith("\ufffd")):
            print(after[len(before) :], end="\n" if last else "", flush=True)
            self.context, self.shown = self.shown, len(self.ids)


# --- the command ------------------------------------------------------------------------


def check_choices(cfg: GenerateConfig, where: MeshConfig) -> None:
    """UsageError for flags out of range or given together without sense, before any device
    work (the vocab- and length-dependent checks follow once the source is described)."""
    if bool(cfg.checkpoint) == bool(cfg.from_hf):
        raise UsageError("give exactly one of --checkpoint DIR and --from-hf DIR")
    if cfg.step < 0:
        raise UsageError(f"--step {cfg.step} must be a checkpoint step, or 0 (the newest)")
    if cfg.step and cfg.from_hf:
        raise UsageError(f"--step {cfg.step} picks a step of --checkpoint; --from-hf has none")
    if cfg.lora_base and cfg.from_hf:
        raise UsageError(
            f"--lora-base {cfg.lora_base} names the base of a LoRA --checkpoint; --from-hf "
            f"reads no adapters"
        )
    if cfg.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {cfg.max_new_tokens} must be at least 1")
    cfg.sampling.check()
    if not 0 <= cfg.seed < 2**63:
        raise UsageError(f"--seed {cfg.seed} must be an integer in [0, 2**63)")
    from spmd.parallel.mesh import check_section

    check_section(where)


def read_prompts(cfg: GenerateConfig) -> list[str]:
    if bool(cfg.prompt) == bool(cfg.prompts_file):
        raise UsageError("give exactly one of --prompt TEXT and --prompts-file PATH")
    if cfg.prompt:
        prompts = [cfg.prompt]
    else:
        try:
            lines = Path(cfg.prompts_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise UsageError(f"--prompts-file {cfg.prompts_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UsageError(
                f"--prompts-file {cfg.prompts_file} is not UTF-8 text (byte {e.start}); give "
                f"one prompt per line"
            ) from None
        prompts = [line for line in lines if line]
        if not prompts:
            raise UsageError(f"--prompts-file {cfg.prompts_file} holds no non-empty line")
    if cfg.num_samples < 1:
        raise UsageError(f"--num-samples {cfg.num_samples} must be at least 1")
    return [p for p in prompts for _ in range(cfg.num_samples)]


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    sections = {"generate": GenerateConfig, "mesh": MeshConfig}
    about = __doc__.split("\n\n")[0]
    resolved = config.resolve(argv, sections, "python -m spmd.generate", description=about)
    cfg, where = resolved["generate"], resolved["mesh"]
    check_choices(cfg, where)
    texts = read_prompts(cfg)
    cfg = hub.resolve_section(cfg)  # Hub ids in --from-hf, --tokenizer: local folders
    from spmd.io import params_io
    from spmd.run import weights

    if cfg.checkpoint:  # the folder and step exist (reading their config needs the mesh)
        params_io.pick_step(cfg.checkpoint, cfg.step)

    # A Hugging Face folder is read without JAX, so its mistakes come before the mesh; a
    # checkpoint's config is read through orbax, which starts the backend: after it.
    source = weights.describe("", 0, cfg.from_hf) if cfg.from_hf else None
    layout = weights.setup_layout(where.mesh, where.devices, where.zero)
    source = source or weights.describe(cfg.checkpoint, cfg.step, "")  # no param read yet
    codec = codec_for(cfg, source.run_config, source.model.vocab_size)
    prompts = encode_prompts(cfg, texts, codec, source.run_config)
    check_vocab(prompts, source.model.vocab_size)
    stops = stop_ids(cfg, source.run_config, codec)
    check_length(cfg, prompts, source, layout)
    if cfg.checkpoint:
        loaded = weights.from_checkpoint(cfg.checkpoint, cfg.step, layout, cfg.lora_base)
    else:
        loaded = weights.from_hf(cfg.from_hf, layout)
    show = Stream(codec) if cfg.stream and len(prompts) == 1 else None
    if show is not None and not cfg.chat:  # a chat prints the reply only
        print(shown(texts[0]), end="", flush=True)
    clock = decoding.Clock()
    completions = generate(
        loaded.program,
        loaded.params,
        prompts,
        cfg.max_new_tokens,
        cfg.sampling,
        cfg.seed,
        stops,
        show,
        stream=show is not None,
        clock=clock,
    )
    if show is not None:
        show([[]], last=True)  # what a partial character held back, and the line's end
    else:
        for i, (text, ids) in enumerate(zip(texts, completions, strict=True)):
            if len(texts) > 1:
                print(f"=== sample {i + 1} ===")
            print(("" if cfg.chat else shown(text)) + codec.decode(ids), flush=True)
    print(speed_line(completions, clock, f"{loaded.source} on mesh {where.mesh}"), file=sys.stderr)
    return 0


def speed_line(completions: list[list[int]], clock: decoding.Clock, where: str) -> str:
    """The closing line: the tokens generated, in how long, how fast; and apart, the wait for
    the first tokens (prefill and its compile), the decode loop's compile and the pace of
    the tokens after the first."""
    count = sum(map(len, completions))
    seconds = clock.first + clock.compile + clock.rest
    rest = count - len(completions)
    pace = f", then {rest / clock.rest:.1f} tokens/s" if rest and clock.rest > 0 else ""
    return (
        f"generated {count} tokens in {seconds:.2f} s ({count / seconds:.1f} tokens/s; the "
        f"first after {clock.first:.2f} s with the prefill's compile, {clock.compile:.2f} s "
        f"compiling the decode loop{pace}) from {where}"
    )


if __name__ == "__main__":
    sys.exit(main())
