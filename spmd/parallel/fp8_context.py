"""Which matmuls run in fp8 while a step is traced, and the delayed-scaling slots they use.

The engine opens `use(settings)` around the loss it differentiates (spmd.engine.step), so a
model needs no flag: `models.layers.dense` asks `site(k, n)` (through spmd.parallel.hooks)
whether its matmul runs in fp8. Only the matmuls of the stacked transformer blocks do
(`hooks.scan_layers` opens `in_block`), and only where both the contracted dim k and the
output dim n reach `settings.min_dim`: the embeddings, the LM head, the router and every
small matmul stay in the compute dtype (docs/strategies/fp8.md says why).

Delayed scaling (recipe "delayed") reads its scales from an amax history kept in the train
state (spmd.engine.fp8_state): the step passes the per-layer scales and a zero "probe" of
shape [layers, SITES, 3] into `use`; the layer scan slices both per layer (`layer_slots`),
and the i-th fp8 matmul of a layer takes row i. The quantized matmul returns the amaxes it
saw (input, weight, gradient) as the probe's cotangent, the trick Flax's fp8 ops play with
their OVERWRITE_WITH_GRADIENT variables, so one `jax.grad` gives every layer's new amaxes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

RECIPES = ("tensorwise", "rowwise", "delayed")
# The output gradient's fp8 format per recipe (docs/strategies/fp8.md, "Formats", measures
# it). With one scale per row (rowwise) the range between a row's largest and smallest
# gradients is small, and e4m3's third mantissa bit halves e5m2's rounding error (torchao's
# rowwise recipe; DeepSeek-V3 with its tile scales). One scale for a whole [tokens, features]
# gradient (tensorwise) must span its spread across tokens: in the tiny model up to 11% of a
# gradient's elements fell below e4m3's normal range under a per-tensor scale, 0.2% below
# e5m2's; and a delayed scale, from earlier steps' amaxes, can sit far above this step's.
# There e5m2's 30 binades (e4m3: 15) keep them (Transformer Engine's HYBRID format, torchao's
# tensorwise default).
GRAD_FORMAT = {"tensorwise": "e5m2", "rowwise": "e4m3", "delayed": "e5m2"}
FORMAT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # the largest finite value of each format
SITES = 16  # fp8 matmuls a layer may hold under delayed scaling (Llama: 7, an MoE block: 7)


@dataclasses.dataclass(frozen=True)
class Fp8Settings:
    """How the blocks' matmuls run in fp8 (spmd.sections.PrecisionConfig's fp8 fields)."""

    recipe: str = "tensorwise"  # one of RECIPES
    min_dim: int = 512  # a matmul runs in fp8 only when its k and n are both at least this
    all_gather: bool = False  # ZeRO-3 gathers the blocks' weights in e4m3 with their scales
    history: int = 16  # steps of amax history (delayed)
    emulate: bool = False  # run on a GPU without fp8 units (compute capability below 8.9)
    layers: int = 0  # rows of the delayed state: the model's stacked layers (set by the engine)


@dataclasses.dataclass
class _Traced:
    settings: Fp8Settings
    scales: Any = None  # [layers, SITES, 3] fp32 (delayed) or None
    probe: Any = None  # [layers, SITES, 3] zeros whose cotangent is the amaxes seen
    layer_scales: Any = None  # this layer's [SITES, 3] rows, inside the layer scan
    layer_probe: Any = None
    in_block: bool = False
    next_site: int = 0
    layer_offset: int = 0  # rows used by earlier scans of the same trace
    # (k, n) of each matmul that asked `site`, one list per block traced (`block_matmuls`)
    blocks: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)


_STATE = threading.local()


def _current() -> _Traced | None:
    return getattr(_STATE, "traced", None)


@contextlib.contextmanager
def use(settings: Fp8Settings | None, scales: Any = None, probe: Any = None) -> Iterator[None]:
    """Trace the blocks' matmuls in fp8 by `settings` (None: nothing changes); under delayed
    scaling with `scales` and `probe` ([layers, SITES, 3]) from spmd.engine.fp8_state.
    Without scales inside an open context (the step's, which has them) nothing changes."""
    if settings is None or (scales is None and _current() is not None):
        yield
        return
    before = _current()
    _STATE.traced = _Traced(settings, scales, probe)
    try:
        yield
    finally:
        _STATE.traced = before


def settings() -> Fp8Settings | None:
    """The fp8 settings of the step being traced (None: no fp8)."""
    traced = _current()
    return traced.settings if traced else None


def delayed_active() -> bool:
    """Whether the step being traced passed delayed-scaling state (the layer scans carry it)."""
    traced = _current()
    return traced is not None and traced.scales is not None


def delayed_rows(n_layers: int) -> tuple[Any, Any] | None:
    """(scales, probe) rows [n_layers, SITES, 3] for the next layer scan of this trace, or None
    when not under delayed scaling (or when the step passed no state, e.g. an eval step)."""
    traced = _current()
    if traced is None or traced.scales is None:
        return None
    start = traced.layer_offset
    if start + n_layers > traced.scales.shape[0]:
        raise ValueError(f"delayed fp8 state holds {traced.scales.shape[0]} layers, not more")
    traced.layer_offset += n_layers
    rows = slice(start, start + n_layers)
    return traced.scales[rows], traced.probe[rows]


@contextlib.contextmanager
def in_block(scales: Any = None, probe: Any = None) -> Iterator[None]:
    """Inside one stacked block (the layer scan's body): its matmuls may run in fp8, the i-th
    taking row i of `scales` / `probe` ([SITES, 3]) under delayed scaling."""
    traced = _current()
    if traced is None:
        yield
        return
    saved = (traced.in_block, traced.next_site, traced.layer_scales, traced.layer_probe)
    traced.in_block, traced.next_site = True, 0
    traced.blocks.append([])
    traced.layer_scales, traced.layer_probe = scales, probe
    try:
        yield
    finally:
        traced.in_block, traced.next_site, traced.layer_scales, traced.layer_probe = saved


@dataclasses.dataclass(frozen=True)
class Site:
    """One fp8 matmul: its recipe and, under delayed scaling, its scales and probe ([3]:
    input, weight, gradient)."""

    recipe: str
    scales: Any = None
    probe: Any = None

    @property
    def grad_format(self) -> str:
        """The fp8 format of the output gradient in the backward products ("e4m3", "e5m2")."""
        return GRAD_FORMAT[self.recipe]


def site(k: int, n: int) -> Site | None:
    """The fp8 site of a matmul contracting `k` into `n` outputs, or None where it stays in
    the compute dtype (no fp8, outside the blocks, or below the size rule)."""
    traced = _current()
    if traced is None or not traced.in_block:
        return None
    s = traced.settings
    traced.blocks[-1].append((k, n))
    if not reaches(s, k, n):
        return None
    if s.recipe != "delayed" or traced.layer_scales is None:
        # without a history (an eval step) delayed scaling falls back to current scaling
        return Site("rowwise" if s.recipe == "rowwise" else "tensorwise")
    i = traced.next_site
    if i >= SITES:
        raise ValueError(f"a block holds more than {SITES} fp8 matmuls; raise fp8_context.SITES")
    traced.next_site += 1
    return Site("delayed", traced.layer_scales[i], traced.layer_probe[i])


def gather_in_fp8(shape: tuple[int, ...]) -> bool:
    """Whether a block's param of this (per-layer) shape is all-gathered in e4m3: a matrix
    whose every dim reaches the size rule, under --fp8-all-gather."""
    traced = _current()
    if traced is None or not traced.settings.all_gather or len(shape) < 2:
        return False
    return reaches(traced.settings, *shape)


def reaches(settings: Fp8Settings, *dims: int) -> bool:
    """The size rule: whether a matmul (its contracted k and output n) or a weight (its dims)
    is large enough for fp8, every dim at least settings.min_dim (--fp8-min-dim)."""
    return min(dims) >= settings.min_dim


def block_matmuls(trace: Callable[[], Any], settings: Fp8Settings) -> list[tuple[int, int]]:
    """(k, n) of each matmul of one stacked block, in call order, that `trace()` (which traces
    a model's loss, e.g. under jax.eval_shape) asks `site` about under `settings`: the
    matmuls the size rule decides on, those that run in fp8 and those it keeps out. Empty for
    a model without stacked blocks."""
    with use(settings):
        traced = _current()
        trace()
    assert traced is not None
    return traced.blocks[0] if traced.blocks else []
