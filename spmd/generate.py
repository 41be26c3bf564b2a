"""`python -m spmd.generate`: sample text from a checkpoint with a key/value cache, on any mesh.

    python -m spmd.generate --checkpoint runs/ckpt --prompt "def " --max-new-tokens 200
    python -m spmd.generate --from-hf path/to/hf_llama --prompts-file prompts.txt --top-k 40

The params come from an spmd checkpoint folder (a training run's `--checkpoint-dir`, or the
`--to` folder of spmd.convert) or a Hugging Face Llama or Mixtral folder, read straight into
the param shardings of `--mesh`. Text is byte-level unless a tokenizer is given or the
checkpoint was trained with one (`--tokenizer` in its config; `tokenizer.json` in a Hugging
Face folder).

All prompts (`--prompt`, or one per line of `--prompts-file`, each `--num-samples` times) form
one batch. They are right-padded to the longest and every row keeps its own positions (see
models/llama_decode.py); the batch is padded with copies of its last row to a multiple of the
mesh's data-parallel size. One jitted function runs the prefill and then a `lax.scan` of
single-token steps; `--temperature 0` is greedy decoding.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spmd import config
from spmd.errors import UsageError, run_command
from spmd.io import hub


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """What to sample from and how. Lengths are in tokens."""

    checkpoint: str = ""  # spmd checkpoint folder (a run's --checkpoint-dir or convert's --to)
    step: int = 0  # checkpoint step to read (0: the newest)
    from_hf: str = ""  # a Hugging Face folder or Hub id (org/name) instead of --checkpoint
    prompt: str = ""  # the text to continue
    prompts_file: str = ""  # or: one prompt per line
    num_samples: int = 1  # samples per prompt
    max_new_tokens: int = 200  # tokens sampled after each prompt
    temperature: float = 0.8  # softmax temperature; 0 is greedy
    top_k: int = 0  # sample among the k likeliest tokens (0: all)
    seed: int = 0  # of the sampling
    tokenizer: str = ""  # tokenizer.json, its folder or a Hub id (empty: the checkpoint's)
    mesh: str = "dp=-1"  # the mesh the params are held on, e.g. "tp=2" (-1: the rest)
    devices: int = 0  # simulate this many CPU devices (0: as many as the mesh needs)
    zero: int = 3  # how params are sharded over fsdp, as in training


# --- sampling -------------------------------------------------------------------------------


def sample(logits: Any, key: Any, temperature: float, top_k: int) -> Any:
    """Token ids [batch] drawn from logits [batch, vocab] (argmax when temperature is 0)."""
    import jax
    import jax.numpy as jnp

    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


_SAMPLERS: dict[tuple, tuple[Any, Callable]] = {}  # (id(program), ...) -> (program, sampler)


def sampler(
    program: Any, max_new_tokens: int, temperature: float, top_k: int
) -> Callable[[Any, Any, Any, Any], Any]:
    """A jitted (params, tokens [b, p], lengths [b], key) -> new tokens [b, max_new_tokens]:
    prefill of the right-padded prompts, then one cached decoding step per further token.
    Made once per (program, settings), so repeated calls reuse the compiled function."""
    key = (id(program), max_new_tokens, temperature, top_k)
    if key not in _SAMPLERS:  # the entry keeps the program alive, so its id stays unique
        _SAMPLERS[key] = (program, _make_sampler(program, max_new_tokens, temperature, top_k))
    return _SAMPLERS[key][1]


def _make_sampler(
    program: Any, max_new_tokens: int, temperature: float, top_k: int
) -> Callable[[Any, Any, Any, Any], Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import llama_decode
    from spmd.parallel import traced_layout

    layout = program.layout

    def run(params: Any, tokens: Any, lengths: Any, key: Any) -> Any:
        with traced_layout.activation_layout(layout.mesh, layout.zero_stage):
            model = nnx.merge(program.graphdef, params)
            batch, prompt_len = tokens.shape
            cache = llama_decode.init_cache(
                model.cfg, batch, prompt_len + max_new_tokens, model.dtype
            )
            positions = jnp.broadcast_to(jnp.arange(prompt_len), tokens.shape)
            logits, cache = llama_decode.forward(model, tokens, positions, cache)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
            keys = jax.random.split(key, max_new_tokens)
            first = sample(last, keys[0], temperature, top_k)

            def step(carry: tuple, step_key: Any) -> tuple[tuple, Any]:
                token, position, cache = carry
                logits, cache = llama_decode.forward(
                    model, token[:, None], position[:, None], cache
                )
                token = sample(logits[:, 0], step_key, temperature, top_k)
                return (token, position + 1, cache), token

            _, rest = jax.lax.scan(step, (first, lengths, cache), keys[1:])
            return jnp.concatenate([first[:, None], rest.T], axis=1)

    batch_sharding = layout.batch_sharding()
    return jax.jit(
        run,
        in_shardings=(
            jax.tree.map(lambda x: x.sharding, program.abstract_params),
            batch_sharding,
            layout.batch_sharding(1),
            layout.replicated,
        ),
        out_shardings=batch_sharding,
    )


def generate(
    program: Any,
    params: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[list[int]]:
    """The `max_new_tokens` token ids sampled after each prompt (lists of ids, any lengths)."""
    import jax
    import numpy as np

    if not prompts or any(len(p) == 0 for p in prompts):
        raise UsageError("every prompt needs at least one token; give non-empty text")
    vocab = program.abstract_params["embed"].shape[0]
    largest = max(max(p) for p in prompts)
    if largest >= vocab:
        raise UsageError(f"a prompt holds token id {largest}, beyond the model's vocab {vocab}")
    check_sampling(max_new_tokens, temperature, top_k, vocab)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > POSITION_LIMIT:
        raise UsageError(
            f"--max-new-tokens {max_new_tokens} after a prompt of {longest} tokens passes the "
            f"{POSITION_LIMIT} positions int32 holds"
        )
    ways = program.layout.data_parallel
    rows = list(prompts) + [prompts[-1]] * (-len(prompts) % ways)
    lengths = np.array([len(p) for p in rows], np.int32)
    tokens = np.zeros((len(rows), lengths.max()), np.int32)
    for i, prompt in enumerate(rows):
        tokens[i, : len(prompt)] = prompt
    layout = program.layout
    run = sampler(program, max_new_tokens, float(temperature), int(top_k))
    out = run(
        params,
        jax.device_put(tokens, layout.batch_sharding()),
        jax.device_put(lengths, layout.batch_sharding(1)),
        jax.random.key(seed),
    )
    return np.asarray(jax.device_get(out))[: len(prompts)].tolist()


# Positions are int32 in the decoder (jnp.arange, the cache index): the hard upper bound.
POSITION_LIMIT = 2**31 - 1
CACHE_ITEMSIZE = 4  # bytes per cached key or value: generation runs the fp32 policy


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, vocab: int = 0) -> None:
    """UsageError for sampling settings out of range (`vocab` 0: not known yet)."""
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if not 0 <= temperature < math.inf:  # NaN fails every comparison
        raise UsageError(f"--temperature {temperature} must be a finite number >= 0 (0: greedy)")
    if top_k < 0 or (vocab and top_k > vocab):
        valid = f"in 0..{vocab}" if vocab else ">= 0"
        raise UsageError(f"--top-k {top_k} must be {valid} (0: all tokens)")


def check_length(cfg: GenerateConfig, prompts: list[list[int]], source: Any, layout: Any) -> None:
    """UsageError when the prompts plus --max-new-tokens pass the positions the source declares
    (config.json's max_position_embeddings; int32's otherwise), or when the key/value cache and
    params cannot fit the mesh's devices even spread evenly over all of them (checked before
    anything is allocated)."""
    import jax

    from models import family
    from spmd.observe.capacity import device_capacity, human_bytes

    longest = max(len(p) for p in prompts)
    total, limit = longest + cfg.max_new_tokens, source.max_positions or POSITION_LIMIT
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
            f"{total} positions and the params need at least {human_bytes(need)} per device "
            f"(spread over all {mesh.size}) but a device holds {human_bytes(capacity.bytes)} "
            f"({capacity.source}); give fewer --max-new-tokens or prompts, or more devices"
        )


# --- text -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Codec:
    """Text <-> token ids: a Hugging Face tokenizer, or bytes (ids 0..255)."""

    tokenizer: Any  # tokenizers.Tokenizer or None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids)


def codec_for(cfg: GenerateConfig, run_config: dict[str, Any], vocab: int) -> Codec:
    """--tokenizer, else the tokenizer the checkpoint was trained or converted with, else a
    Hugging Face folder's tokenizer.json; bytes if none."""
    from spmd.io.tokens import _load_tokenizer

    path = (
        cfg.tokenizer
        or config.flat_values(run_config).get("tokenizer", "")
        or run_config.get("tokenizer", "")  # a converted checkpoint's
    )
    beside = Path(cfg.from_hf) / "tokenizer.json" if cfg.from_hf else None
    if not path and beside is not None and beside.is_file():
        path = str(beside)
    if path:
        return Codec(_load_tokenizer(path))
    if vocab > 256:
        raise UsageError(
            f"the model's vocab {vocab} is not byte-level (256) and no tokenizer is known; "
            f"give --tokenizer PATH (a tokenizer.json)"
        )
    return Codec(None)


# --- the command ------------------------------------------------------------------------


def check_choices(cfg: GenerateConfig) -> None:
    """UsageError for flags out of range or given together without sense, before any device
    work (the vocab- and length-dependent checks follow once the source is described)."""
    if bool(cfg.checkpoint) == bool(cfg.from_hf):
        raise UsageError("give exactly one of --checkpoint DIR and --from-hf DIR")
    if cfg.step < 0:
        raise UsageError(f"--step {cfg.step} must be a checkpoint step, or 0 (the newest)")
    if cfg.step and cfg.from_hf:
        raise UsageError(f"--step {cfg.step} picks a step of --checkpoint; --from-hf has none")
    check_sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k)
    if not 0 <= cfg.seed < 2**63:
        raise UsageError(f"--seed {cfg.seed} must be an integer in [0, 2**63)")
    if cfg.devices < 0:
        raise UsageError(f"--devices {cfg.devices} must be >= 0 (0: as many as the mesh needs)")
    from spmd.parallel.mesh import parse_mesh

    parse_mesh(cfg.mesh)


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
    sections = {"generate": GenerateConfig}
    about = __doc__.split("\n\n")[0]
    cfg = config.resolve(argv, sections, "python -m spmd.generate", description=about)["generate"]
    check_choices(cfg)
    texts = read_prompts(cfg)
    cfg = hub.resolve_section(cfg)  # Hub ids in --from-hf, --tokenizer: local folders
    from spmd import weights
    from spmd.io import params_io

    if cfg.checkpoint:  # the folder and step exist (reading their config needs the mesh)
        params_io.pick_step(cfg.checkpoint, cfg.step)

    # A Hugging Face folder is read without JAX, so its mistakes come before the mesh; a
    # checkpoint's config is read through orbax, which starts the backend: after it.
    source = weights.describe("", 0, cfg.from_hf) if cfg.from_hf else None
    layout = weights.setup_layout(cfg.mesh, cfg.devices, cfg.zero)
    source = source or weights.describe(cfg.checkpoint, cfg.step, "")  # no param read yet
    codec = codec_for(cfg, source.run_config, source.model.vocab_size)
    prompts = [codec.encode(text) for text in texts]
    check_length(cfg, prompts, source, layout)
    if cfg.checkpoint:
        loaded = weights.from_checkpoint(cfg.checkpoint, cfg.step, layout)
    else:
        loaded = weights.from_hf(cfg.from_hf, layout)
    started = time.perf_counter()
    completions = generate(
        loaded.program,
        loaded.params,
        prompts,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_k,
        cfg.seed,
    )
    seconds = time.perf_counter() - started
    print(
        f"{loaded.source}: {len(prompts)} x {cfg.max_new_tokens} tokens in {seconds:.1f} s "
        f"(compile included) on mesh {cfg.mesh}",
        file=sys.stderr,
    )
    for i, (text, ids) in enumerate(zip(texts, completions, strict=True)):
        if len(texts) > 1:
            print(f"=== sample {i + 1} ===")
        print(text + codec.decode(ids), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
