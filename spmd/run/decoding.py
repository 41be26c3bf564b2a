"""The decoding loop of spmd.generate: a jitted prefill of the prompts, then jitted chunks of
one-token steps with the key/value cache (the model family's Decoder), on any mesh.

Prompts of different lengths are right-padded and every row keeps its own positions, so a
row's continuation is the one it would get alone. Each row stops at its first end-of-sequence
id: a `done` mask travels in the loop state, a finished row's later tokens are padding that
the host drops, and a chunk's `lax.while_loop` ends as soon as every row is done, so a batch
that finishes early stops computing. Rows added to fill the data-parallel size start done.

A chunk runs up to `chunk` steps and hands their tokens to the host. Printing the whole text
at the end makes the whole generation one chunk (one call); streaming makes chunks of one
token, so each token is on the host (and printed) as soon as it is sampled. The loop state (the
cache above all) is donated from chunk to chunk, so the cache is updated in place.

Sampling applies the temperature, then top-k, then top-p (nucleus), as Hugging Face's sampling
does; token i of a row is drawn with `fold_in(key, i)`, so the chunk size never changes what
is sampled.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spmd.errors import UsageError

if TYPE_CHECKING:
    from spmd.engine.step import Program

# Positions are int32 in the decoder (jnp.arange, the cache index): the hard upper bound.
POSITION_LIMIT = 2**31 - 1
PAD = 0  # what a finished row emits (dropped on the host)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each token is drawn: temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self, vocab: int = 0) -> None:
        """UsageError for settings out of range (`vocab` 0: not known yet)."""
        if not 0 <= self.temperature < math.inf:  # NaN fails every comparison
            raise UsageError(
                f"--temperature {self.temperature} must be a finite number >= 0 (0: greedy)"
            )
        if self.top_k < 0 or (vocab and self.top_k > vocab):
            valid = f"in 0..{vocab}" if vocab else ">= 0"
            raise UsageError(f"--top-k {self.top_k} must be {valid} (0: all tokens)")
        if not 0 < self.top_p <= 1:
            raise UsageError(
                f"--top-p {self.top_p} must be in (0, 1]: the probability mass sampled from "
                f"(1: all tokens; near 0: the likeliest token only)"
            )


def sample(logits: Any, key: Any, how: Sampling) -> Any:
    """Token ids [batch] drawn from logits [batch, vocab] (argmax when the temperature is 0)."""
    import jax
    import jax.numpy as jnp

    if how.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / how.temperature
    if how.top_k:
        kth = jax.lax.top_k(logits, how.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if how.top_p < 1:
        logits = nucleus(logits, how.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def nucleus(logits: Any, p: float) -> Any:
    """`logits` [batch, vocab] with -inf for every token outside the smallest set of likeliest
    tokens whose probabilities sum to p or more (the likeliest token always stays)."""
    import jax
    import jax.numpy as jnp

    ordered = -jnp.sort(-logits, axis=-1)  # descending
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
    kept = before < p
    threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)


class Decoder:
    """The jitted prefill and decode chunk of one program, sampling and chunk size.

    prefill(params, tokens [b, p], lengths [b], done [b], key, eos [n], new_tokens) -> state
    decode(params, state, key, eos [n], limit) -> (state, tokens [b, chunk], steps run)

    The state: {"token", "position", "done"} [b], "index" (tokens sampled so far) and
    "cache"."""

    def __init__(self, program: Program, how: Sampling, chunk: int):
        import jax

        self.program, self.how, self.chunk = program, how, chunk
        layout = program.layout
        params = jax.tree.map(lambda x: x.sharding, program.abstract_params)
        rows, replicated = layout.batch_sharding(1), layout.replicated
        self.prefill = jax.jit(
            self._prefill,
            in_shardings=(params, layout.batch_sharding(), rows, rows, replicated, replicated),
            static_argnums=6,  # new_tokens: the cache's length
        )
        self.decode = jax.jit(self._decode, donate_argnames="state")

    def _model(self, params: Any) -> Any:
        from flax import nnx

        return nnx.merge(self.program.graphdef, params)

    def _prefill(
        self, params: Any, tokens: Any, lengths: Any, done: Any, key: Any, eos: Any, new_tokens: int
    ) -> dict[str, Any]:
        import jax
        import jax.numpy as jnp

        from models import family
        from spmd.parallel import traced_layout

        layout = self.program.layout
        with traced_layout.activation_layout(layout.mesh, layout.zero_stage):
            model = self._model(params)
            kv = family.of(model.cfg).decoder  # the family's key/value-cache forward
            batch, prompt_len = tokens.shape
            cache = kv.init_cache(model.cfg, batch, prompt_len + new_tokens, model.dtype)
            positions = jnp.broadcast_to(jnp.arange(prompt_len), tokens.shape)
            logits, cache = kv.forward(model, tokens, positions, cache)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
            token = sample(last, jax.random.fold_in(key, 0), self.how)
        return {
            "token": token,
            "position": lengths,
            "done": done | jnp.isin(token, eos),
            "index": jnp.int32(1),
            "cache": cache,
        }

    def _decode(
        self, params: Any, state: dict[str, Any], key: Any, eos: Any, limit: Any
    ) -> tuple[dict[str, Any], Any, Any]:
        import jax
        import jax.numpy as jnp

        from models import family
        from spmd.parallel import traced_layout

        layout = self.program.layout
        batch = state["token"].shape[0]

        def running(carry: tuple) -> Any:
            step, state, _ = carry
            return (step < limit) & ~jnp.all(state["done"])

        def one_token(carry: tuple) -> tuple:
            step, state, out = carry
            token, position = state["token"][:, None], state["position"][:, None]
            logits, cache = kv.forward(model, token, position, state["cache"])
            token = sample(logits[:, 0], jax.random.fold_in(key, state["index"]), self.how)
            token = jnp.where(state["done"], PAD, token)  # a finished row pads
            state = {
                "token": token,
                "position": state["position"] + 1,
                "done": state["done"] | jnp.isin(token, eos),
                "index": state["index"] + 1,
                "cache": cache,
            }
            return step + 1, state, out.at[:, step].set(token)

        with traced_layout.activation_layout(layout.mesh, layout.zero_stage):
            model = self._model(params)
            kv = family.of(model.cfg).decoder  # the family's key/value-cache forward
            out = jnp.full((batch, self.chunk), PAD, jnp.int32)
            steps, state, out = jax.lax.while_loop(running, one_token, (0, state, out))
        return state, out, steps


_DECODERS: dict[tuple, Decoder] = {}  # (id(program), sampling, chunk) -> Decoder


def decoder(program: Program, how: Sampling, chunk: int) -> Decoder:
    """The Decoder of (program, how, chunk), made once, so repeated calls reuse its compiled
    functions (the entry keeps the program alive, so its id stays unique)."""
    key = (id(program), how, chunk)
    if key not in _DECODERS:
        _DECODERS[key] = Decoder(program, how, chunk)
    return _DECODERS[key]


@dataclasses.dataclass
class Clock:
    """Where a generation's seconds went: to the first tokens on the host (the prefill, its
    compile included), compiling the decode loop, and decoding the rest."""

    first: float = 0.0
    compile: float = 0.0
    rest: float = 0.0


def generate(
    program: Program,
    params: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    how: Sampling = Sampling(),
    seed: int = 0,
    eos: tuple[int, ...] = (),
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    stream: bool = False,
    clock: Clock | None = None,
) -> list[list[int]]:
    """The token ids sampled after each prompt (lists of ids, any lengths): `max_new_tokens`,
    or fewer where a row reaches an id of `eos` (which ends its list). `on_tokens(new)` gets
    each row's new ids as they reach the host: the first token, then the rest at once, or
    one at a time with `stream`. `clock` (if given) is filled in."""
    import jax
    import numpy as np

    check(program, prompts, max_new_tokens, how)
    clock = clock if clock is not None else Clock()
    started = time.perf_counter()
    run = decoder(program, how, 1 if stream else max(max_new_tokens - 1, 1))
    key, stops = jax.random.key(seed), np.array(eos, np.int32)
    state = run.prefill(params, *_batch(program.layout, prompts), key, stops, max_new_tokens)
    new = np.asarray(jax.device_get(state["token"]))[:, None]
    clock.first = time.perf_counter() - started
    out: list[list[int]] = [[] for _ in prompts]
    produced, compiled = 1, False
    while True:
        gained = _append(out, new, set(eos))
        if on_tokens is not None:
            on_tokens(gained)
        if produced >= max_new_tokens or all(row[-1] in eos for row in out):
            clock.rest = time.perf_counter() - started - clock.first - clock.compile
            return out
        limit = np.int32(min(run.chunk, max_new_tokens - produced))
        if not compiled:  # ahead of the first call (which reuses it), to time it apart
            began = time.perf_counter()
            run.decode.lower(params, state, key, stops, limit).compile()
            clock.compile, compiled = time.perf_counter() - began, True
        state, chunk, steps = run.decode(params, state, key, stops, limit)
        new = np.asarray(jax.device_get(chunk))[:, : int(steps)]
        produced += int(limit)


def check(program: Program, prompts: list[list[int]], max_new_tokens: int, how: Sampling) -> None:
    """UsageError for prompts or settings the model cannot take."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UsageError("every prompt needs at least one token; give non-empty text")
    vocab = program.abstract_params["embed"].shape[0]
    largest = max(max(p) for p in prompts)
    if largest >= vocab:
        raise UsageError(f"a prompt holds token id {largest}, beyond the model's vocab {vocab}")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    how.check(vocab)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > POSITION_LIMIT:
        raise UsageError(
            f"--max-new-tokens {max_new_tokens} after a prompt of {longest} tokens passes the "
            f"{POSITION_LIMIT} positions int32 holds"
        )


def _batch(layout: Any, prompts: list[list[int]]) -> tuple[Any, Any, Any]:
    """(tokens [b, longest], lengths [b], done [b]) on the devices: the prompts right-padded,
    and copies of the last one up to a multiple of the data-parallel size, which start done
    (they never hold the loop)."""
    import jax
    import numpy as np

    rows = list(prompts) + [prompts[-1]] * (-len(prompts) % layout.data_parallel)
    lengths = np.array([len(p) for p in rows], np.int32)
    tokens = np.zeros((len(rows), lengths.max()), np.int32)
    for i, prompt in enumerate(rows):
        tokens[i, : len(prompt)] = prompt
    padding = np.arange(len(rows)) >= len(prompts)
    rows_sharding = layout.batch_sharding(1)
    return (
        jax.device_put(tokens, layout.batch_sharding()),
        jax.device_put(lengths, rows_sharding),
        jax.device_put(padding, rows_sharding),
    )


def _append(out: list[list[int]], new: Any, eos: set[int]) -> list[list[int]]:
    """Add each row's `new` tokens (of the real rows, up to and with its first eos) to `out`;
    returns what each row gained."""
    gained = []
    for row, tokens in zip(out, new, strict=False):  # `new` may hold padding rows too
        ended = bool(row) and row[-1] in eos
        take = []
        for token in [] if ended else tokens.tolist():
            take.append(token)
            if token in eos:
                break
        row.extend(take)
        gained.append(take)
    return gained
