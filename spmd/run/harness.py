"""lm-evaluation-harness's three requests on spmd's sharded forward and decoder, on any mesh:
log-likelihoods of continuations, rolling log-likelihoods of whole texts, and generation until
stop strings. The requests are tokenized as lm-eval's Hugging Face backend tokenizes them
(spmd/run/harness_text.py); spmd/run/lm_eval_bridge.py hands them over from lm-eval.

Scoring runs in batches of --batch-size rows (a multiple of the data-parallel ways: filler rows
make up the last batch), longest first, each right-padded to a bucket length: a power of two
from 16 up to --max-length. So an evaluation compiles one program per bucket it meets, a
handful, not one per request. The forward is the model's own (`Program.model(params)`) under
the layout's activation shardings, and only each row's log-probabilities of its targets and
whether they are the argmax leave the devices, never the logits. Generation is
spmd.generate's decoding loop (spmd/run/decoding.py) with the key/value cache.

No lm_eval here: the suite tests these numbers against lm-eval's own without it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from spmd.errors import UsageError
from spmd.run import harness_text
from spmd.run.decoding import Sampling, generate
from spmd.run.harness_text import Text
from spmd.sections import DataConfig

if TYPE_CHECKING:
    from spmd.engine.step import Program

SMALLEST_BUCKET = 16  # the shortest padded length a batch of rows is scored at
INSTALL = 'pip install -e ".[eval]"'  # what installs lm-eval beside spmd (pyproject's extra)


def require_lm_eval(flag: str) -> None:
    """UsageError naming `flag` when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UsageError(
            f"{flag} needs lm-evaluation-harness, which is not installed: {INSTALL} (or pip "
            f"install lm-eval)"
        )


def check_training(data: DataConfig) -> None:
    """UsageError for --eval-harness-* flags a training run cannot use (before device work)."""
    if data.eval_harness_every < 0 or data.eval_harness_limit < 0:
        flag = "every" if data.eval_harness_every < 0 else "limit"
        value = getattr(data, f"eval_harness_{flag}")
        raise UsageError(f"--eval-harness-{flag} {value} must be at least 0 (0: off / all)")
    if not data.eval_harness_every:
        return
    require_lm_eval(f"--eval-harness-every {data.eval_harness_every}")
    if not data.eval_harness_tasks.strip(","):
        raise UsageError(
            f"--eval-harness-every {data.eval_harness_every} needs --eval-harness-tasks: lm-eval "
            f"task names, comma-separated"
        )
    folder = data.eval_harness_include_path
    if folder and not Path(folder).is_dir():
        raise UsageError(f"--eval-harness-include-path {folder} is not a folder of task YAMLs")


def bucket(length: int, max_length: int) -> int:
    """The padded length of a batch whose longest input has `length` tokens."""
    padded = SMALLEST_BUCKET
    while padded < length:
        padded *= 2
    return max(length, min(padded, max_length))


@dataclasses.dataclass
class Harness:
    """The requests of one model: `params` of `program` on its mesh, their Text, the longest
    row (lm-eval's max_length) and the rows of a batch. `stop_ids`: the end-of-sequence ids a
    generation stops at beside the Text's end of text."""

    program: Program
    params: Any
    text: Text
    max_length: int
    batch_size: int
    stop_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        ways = self.program.layout.data_parallel
        self.rows = -(-max(self.batch_size, 1) // ways) * ways  # a multiple of the dp ways
        self._scorer = scorer(self.program)

    # --- the three requests ----------------------------------------------------------------

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation)."""
        return self.score([harness_text.pair_ids(self.text, c, x) for c, x in pairs])

    def loglikelihood_rolling(self, texts: list[str]) -> list[float]:
        """Each text's log-likelihood from the prefix token on, over max_length windows."""
        windows, owners = [], []
        for i, text in enumerate(texts):
            ids = self.text.encode(text)
            found = harness_text.rolling_windows(ids, self.text.prefix_id, self.max_length)
            windows += found
            owners += [i] * len(found)
        totals = [0.0] * len(texts)
        for owner, (logp, _) in zip(owners, self.score(windows), strict=True):
            totals[owner] += logp
        return totals

    def generate_until(self, requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """Each context's continuation up to the first stop string (`until`, the EOS text)."""
        out = [""] * len(requests)
        groups: dict[harness_text.Generation, list[int]] = {}
        for i, (_, kwargs) in enumerate(requests):
            how = harness_text.generation(
                kwargs, self.text.eot_text, harness_text.DEFAULT_MAX_GEN_TOKS
            )
            groups.setdefault(how, []).append(i)
        for how, members in groups.items():
            room = self.max_length - how.max_gen_toks
            if room < 1:
                raise UsageError(
                    f"a task asks for {how.max_gen_toks} new tokens, which leaves no room for "
                    f"its context in --max-length {self.max_length}; give a larger --max-length"
                )
            sampling = Sampling(how.temperature, how.top_k, how.top_p)
            eos = tuple(sorted({self.text.eot_id, *self.stop_ids}))
            for start in range(0, len(members), self.rows):
                chunk = members[start : start + self.rows]
                prompts = [self.text.encode(requests[i][0])[-room:] for i in chunk]
                made = generate(
                    self.program, self.params, prompts, how.max_gen_toks, sampling, self.seed, eos
                )
                for i, ids in zip(chunk, made, strict=True):
                    out[i] = harness_text.cut(self.text.decode(ids), how.until)
        return out

    # --- scoring token rows ----------------------------------------------------------------

    def score(self, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-prob, all greedy) of each (context ids, continuation ids)."""
        rows = [harness_text.scored_row(c, x, self.max_length) for c, x in requests]
        counts = [len(x) for _, x in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.rows):
            chunk = order[start : start + self.rows]
            width = bucket(len(rows[chunk[0]]) - 1, self.max_length)
            inputs = np.zeros((self.rows, width), np.int32)
            targets = np.zeros((self.rows, width), np.int32)
            for r, i in enumerate(chunk):
                inputs[r, : len(rows[i]) - 1] = rows[i][:-1]
                targets[r, : len(rows[i]) - 1] = rows[i][1:]
            logp, greedy = self._scorer(self.params, inputs, targets)
            for r, i in enumerate(chunk):
                end = len(rows[i]) - 1
                picked = slice(end - counts[i], end)
                results[i] = (float(logp[r, picked].sum()), bool(greedy[r, picked].all()))
        return results


_SCORERS: dict[int, tuple[Any, Callable]] = {}  # id(program) -> (program, scorer)


def scorer(program: Program) -> Callable[[Any, np.ndarray, np.ndarray], tuple]:
    """score(params, inputs [b, T], targets [b, T]) -> (log p of each target, whether it is
    the argmax) as host arrays [b, T]: one jitted function per program (its compiled programs,
    one per bucket, reused by every later call; the entry keeps the program alive)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spmd.parallel import traced_layout

    if id(program) in _SCORERS:
        return _SCORERS[id(program)][1]
    layout = program.layout

    def forward(params: Any, inputs: Any, targets: Any) -> tuple[Any, Any]:
        with traced_layout.activation_layout(layout.mesh, layout.zero_stage):
            model: Any = nnx.merge(program.graphdef, params)
            logits = model(inputs).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return picked, jnp.argmax(logits, axis=-1) == targets

    params_sharding = jax.tree.map(lambda x: x.sharding, program.abstract_params)
    rows = layout.batch_sharding()
    jitted = jax.jit(forward, in_shardings=(params_sharding, rows, rows))

    def score(params: Any, inputs: np.ndarray, targets: np.ndarray) -> tuple:
        placed = jax.device_put(inputs, rows), jax.device_put(targets, rows)
        logp, greedy = jax.device_get(jitted(params, *placed))
        return np.asarray(logp, np.float64), np.asarray(greedy)

    _SCORERS[id(program)] = (program, score)
    return score
