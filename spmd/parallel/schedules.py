"""Pipeline schedules as static tick tables, built and checked in Python before anything is traced.

The model's stacked layers are cut into C = stages * virtual chunks of equal depth; chunk c
lives on stage c % stages as that stage's local chunk c // stages (round-robin, so with
virtual > 1 a micro-batch goes around the ring `virtual` times). Time is cut into ticks. In one
tick every stage may run one forward slot (a chunk on one micro-batch) and one backward slot,
in that order, then hands its forward output to the next stage and its input gradient to the
previous one (one `ppermute` each way). A tick therefore costs about F + B of one chunk.

A schedule is two per-stage orders of work (forwards, backwards) run as soon as their inputs
are there (ASAP), in order:

    gpipe        forwards m = 0..M-1, then backwards; no backward before the stage's last
                 forward. Stashes all M micro-batches' inputs.
    1f1b         the same orders without that gate: F(m, s) = m + s, B(m, s) = m + 2(S-1) - s.
                 A stage holds at most 2(S-1-s) + 1 inputs, whatever M is.
    interleaved  virtual v >= 2 chunks per stage; micro-batches in groups of S go through local
                 chunk 0, then 1, ... (backwards in the reverse chunk order). Needs M % S == 0.

Buffers: the `stash` holds each chunk input from the tick it arrives (or is embedded) until its
backward reads it; the `inbox` holds each output gradient from the tick it arrives (or the loss
head makes it) until its backward reads it. Slots are reused as soon as they are free.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from spmd.errors import UsageError
from spmd.sections import ParallelConfig, choices

SCHEDULES = choices(ParallelConfig, "pp_schedule")

# Columns of a tick table: one int per (tick, stage); -1 = nothing in that slot.
FIELDS = (
    "f_mb",  # forward slot: micro-batch
    "f_chunk",  # local chunk index (0..virtual-1)
    "f_slot",  # stash slot holding (or, for the first chunk, receiving) the chunk's input
    "f_first",  # 1 if this is model chunk 0 (input = embedded tokens)
    "f_last",  # 1 if this is the last model chunk (the loss head follows)
    "head_slot",  # inbox slot where the loss head writes d loss / d output (-1 forward-only)
    "b_mb",  # backward slot: micro-batch
    "b_chunk",  # local chunk index
    "b_slot",  # stash slot of the chunk's input
    "b_inbox",  # inbox slot of the gradient of the chunk's output
    "b_first",  # 1 if this is model chunk 0 (the gradient goes on into the embedding)
    "recv_f",  # stash slot for the activation arriving from the previous stage (end of tick)
    "recv_b",  # inbox slot for the gradient arriving from the next stage (end of tick)
)
COLUMN = {name: i for i, name in enumerate(FIELDS)}
BACKWARD_COST = 2.0  # cost of a backward slot relative to a forward slot, for idle fractions


class Phase(NamedTuple):
    """Ticks [start, stop) in which the same kinds of slot run somewhere in the pipeline."""

    start: int
    stop: int
    forward: bool
    backward: bool


@dataclasses.dataclass(frozen=True)
class Table:
    """A schedule's tick table: `cells[tick, stage, COLUMN[field]]` and its buffer sizes."""

    schedule: str
    stages: int
    virtual: int
    microbatches: int
    backward: bool
    cells: np.ndarray  # int32 [ticks, stages, len(FIELDS)]
    stash_slots: int
    inbox_slots: int

    @property
    def ticks(self) -> int:
        return self.cells.shape[0]

    def column(self, field: str) -> np.ndarray:
        """One field for every (tick, stage): int32 [ticks, stages]."""
        return self.cells[:, :, COLUMN[field]]

    def phases(self) -> list[Phase]:
        """Maximal runs of ticks with the same slot kinds in use somewhere (warm-up: forwards
        only, steady: both, cool-down: backwards only). Stages run in lockstep and skip their
        idle slots, so a tick costs the slot kinds that some stage uses in it."""
        has_f = np.asarray((self.column("f_chunk") >= 0).any(axis=1))
        has_b = np.asarray((self.column("b_chunk") >= 0).any(axis=1))
        runs: list[Phase] = []
        for t in range(self.ticks):
            kind = (bool(has_f[t]), bool(has_b[t]))
            if runs and (runs[-1].forward, runs[-1].backward) == kind:
                runs[-1] = runs[-1]._replace(stop=t + 1)
            else:
                runs.append(Phase(t, t + 1, *kind))
        return runs

    def idle_fraction(self, backward_cost: float = BACKWARD_COST) -> float:
        """Share of the step's slot time (a tick lasts the slot kinds some stage uses in it)
        in which a stage has nothing to do; a backward slot weighs `backward_cost` forwards."""
        executed = useful = 0.0
        chunks = self.stages * self.virtual
        for phase in self.phases():
            n = phase.stop - phase.start
            executed += self.stages * n * (phase.forward + backward_cost * phase.backward)
        useful = self.microbatches * chunks * (1 + backward_cost * self.backward)
        return 1.0 - useful / executed

    def summary(self) -> dict:
        """What a run reports about its schedule (dry run and the metrics' config record)."""
        return {
            "schedule": self.schedule,
            "stages": self.stages,
            "virtual": self.virtual,
            "microbatches": self.microbatches,
            "ticks": self.ticks,
            "stash_slots": self.stash_slots,
            "bubble_theory": bubble_fraction(self.stages, self.microbatches, self.virtual),
            "idle_fraction": self.idle_fraction(),
        }


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Textbook bubble share of a step: (p - 1) / (M + p - 1), divided by v when interleaved."""
    return (stages - 1) / (microbatches + stages - 1) / virtual


def check_settings(schedule: str, stages: int, microbatches: int, virtual: int) -> None:
    """UsageError unless the schedule can run M micro-batches on this many stages."""
    if schedule not in SCHEDULES:
        raise UsageError(f"--pp-schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if virtual < 1:
        raise UsageError(f"--pp-virtual {virtual} must be a positive number of chunks per stage")
    if schedule == "interleaved" and virtual < 2:
        raise UsageError(
            f"--pp-virtual {virtual}: the interleaved schedule needs at least 2 chunks per "
            f"stage; use --pp-virtual 2 or more, or --pp-schedule 1f1b"
        )
    if schedule != "interleaved" and virtual != 1:
        raise UsageError(
            f"--pp-virtual {virtual} applies only to --pp-schedule interleaved; use 1 with "
            f"{schedule}"
        )
    if microbatches < stages:
        raise UsageError(
            f"--microbatches {microbatches} is fewer than the {stages} pipeline stages; use at "
            f"least {stages}"
        )
    if schedule == "interleaved" and microbatches % stages:
        raise UsageError(
            f"--microbatches {microbatches} is not a multiple of the {stages} pipeline stages, "
            f"which the interleaved schedule needs; use a multiple of {stages}"
        )


def _orders(schedule: str, stages: int, virtual: int, microbatches: int, stage: int) -> tuple:
    """(forward order, backward order) of one stage: lists of (micro-batch, local chunk)."""
    if schedule != "interleaved":
        work = [(m, 0) for m in range(microbatches)]
        return work, work
    forward, backward = [], []
    for group in range(microbatches // stages):
        mbs = range(group * stages, (group + 1) * stages)
        forward += [(m, k) for k in range(virtual) for m in mbs]
        backward += [(m, k) for k in reversed(range(virtual)) for m in mbs]
    return forward, backward


def _run_asap(schedule: str, stages: int, virtual: int, microbatches: int, backward: bool):
    """When each (micro-batch, chunk) runs forward and backward: dicts (m, c) -> (tick, stage)."""
    chunks = stages * virtual
    orders = [_orders(schedule, stages, virtual, microbatches, s) for s in range(stages)]
    f_at: dict[tuple[int, int], tuple[int, int]] = {}
    b_at: dict[tuple[int, int], tuple[int, int]] = {}
    f_next, b_next = [0] * stages, [0] * stages
    total = microbatches * chunks
    limit = 4 * (total + chunks)
    tick = 0
    while len(f_at) < total or (backward and len(b_at) < total):
        if tick > limit:
            raise RuntimeError(f"{schedule} schedule made no progress (a bug in its orders)")
        for s, (f_order, _) in enumerate(orders):
            if f_next[s] < len(f_order):
                m, k = f_order[f_next[s]]
                c = k * stages + s
                if c == 0 or f_at.get((m, c - 1), (math.inf,))[0] <= tick - 1:
                    f_at[(m, c)] = (tick, s)
                    f_next[s] += 1
        for s, (f_order, b_order) in enumerate(orders):
            if not backward or b_next[s] == len(b_order):
                continue
            if schedule == "gpipe" and f_next[s] < len(f_order):
                continue  # all forwards, then all backwards
            m, k = b_order[b_next[s]]
            c = k * stages + s
            if c == chunks - 1:
                ready = f_at.get((m, c), (math.inf,))[0] <= tick  # head runs in the F slot
            else:
                ready = b_at.get((m, c + 1), (math.inf,))[0] <= tick - 1
            if ready:
                b_at[(m, c)] = (tick, s)
                b_next[s] += 1
        tick += 1
    return f_at, b_at, tick


def _allocate(intervals: list[tuple[float, float, tuple]]) -> tuple[dict, int]:
    """Give each (start, end, key) interval a slot no other overlapping interval has."""
    free_at: list[float] = []
    slots = {}
    for start, end, key in sorted(intervals):
        slot = next((i for i, free in enumerate(free_at) if free < start), len(free_at))
        if slot == len(free_at):
            free_at.append(end)
        free_at[slot] = end
        slots[key] = slot
    return slots, len(free_at)


# Moments inside a tick, for buffer lifetimes: the forward slot (embedding, head) writes at
# +0.25, the backward slot reads at +0.5, messages arriving from neighbours land at +0.75.
_F, _B, _RECV = 0.25, 0.5, 0.75


def build(
    schedule: str, stages: int, microbatches: int, virtual: int = 1, backward: bool = True
) -> Table:
    """The tick table of `schedule` on `stages` stages with `virtual` chunks each and
    `microbatches` micro-batches; forward slots only when `backward` is False (evaluation).
    The table is checked by `check` before it is returned."""
    check_settings(schedule, stages, microbatches, virtual)
    chunks = stages * virtual
    f_at, b_at, ticks = _run_asap(schedule, stages, virtual, microbatches, backward)
    cells = np.full((ticks, stages, len(FIELDS)), -1, np.int32)
    put = lambda t, s, field, value: cells.__setitem__((t, s, COLUMN[field]), value)  # noqa: E731

    stash_items: list[list] = [[] for _ in range(stages)]
    inbox_items: list[list] = [[] for _ in range(stages)]
    for (m, c), (tf, s) in f_at.items():
        if c == 0 and not backward:
            continue  # the embedding is read straight from the tokens
        start = tf + _F if c == 0 else f_at[(m, c - 1)][0] + _RECV
        end = b_at[(m, c)][0] + _B if backward else tf + _F
        stash_items[s].append((start, end, (m, c)))
        if backward:
            tb = b_at[(m, c)][0]
            start = tf + _F if c == chunks - 1 else b_at[(m, c + 1)][0] + _RECV
            inbox_items[s].append((start, tb + _B, (m, c)))
    stash = [_allocate(items) for items in stash_items]
    inbox = [_allocate(items) for items in inbox_items]

    for (m, c), (t, s) in f_at.items():
        for field, value in (("f_mb", m), ("f_chunk", c // stages), ("f_first", c == 0)):
            put(t, s, field, value)
        put(t, s, "f_last", c == chunks - 1)
        put(t, s, "f_slot", stash[s][0].get((m, c), -1))
        if c == chunks - 1 and backward:
            put(t, s, "head_slot", inbox[s][0][(m, c)])
        if c < chunks - 1:  # its output lands in the next stage's stash at the end of tick t
            nxt = (s + 1) % stages
            put(t, nxt, "recv_f", stash[nxt][0][(m, c + 1)])
    for (m, c), (t, s) in b_at.items():
        for field, value in (("b_mb", m), ("b_chunk", c // stages), ("b_first", c == 0)):
            put(t, s, field, value)
        put(t, s, "b_slot", stash[s][0][(m, c)])
        put(t, s, "b_inbox", inbox[s][0][(m, c)])
        if c > 0:
            prev = (s - 1) % stages
            put(t, prev, "recv_b", inbox[prev][0][(m, c - 1)])

    table = Table(
        schedule=schedule,
        stages=stages,
        virtual=virtual,
        microbatches=microbatches,
        backward=backward,
        cells=cells,
        stash_slots=max(1, max(n for _, n in stash)),
        inbox_slots=max(1, max(n for _, n in inbox)),
    )
    check(table)
    return table


def check(table: Table) -> None:
    """Run the table on symbolic values and assert what the compiled program relies on: every
    chunk of every micro-batch runs forward (and backward) exactly once on its own stage, reads
    the right input and gradient from its buffers, no slot is overwritten before it is read, and
    messages only cross ring edges that the program's ppermutes carry."""
    stages, chunks, backward = table.stages, table.stages * table.virtual, table.backward
    col = {name: table.column(name) for name in FIELDS}
    stash = [[None] * table.stash_slots for _ in range(stages)]
    inbox = [[None] * table.inbox_slots for _ in range(stages)]
    done_f: set = set()
    done_b: set = set()

    def write(buffer: list, slot: int, value: tuple) -> None:
        assert buffer[slot] is None, f"slot {slot} overwritten with {value} before it was read"
        buffer[slot] = value

    for t in range(table.ticks):
        sent_f: list = [None] * stages
        sent_b: list = [None] * stages
        for s in range(stages):
            if col["f_chunk"][t, s] < 0:
                continue
            m, c = int(col["f_mb"][t, s]), int(col["f_chunk"][t, s]) * stages + s
            assert (m, c) not in done_f and bool(col["f_first"][t, s]) == (c == 0)
            assert bool(col["f_last"][t, s]) == (c == chunks - 1)
            done_f.add((m, c))
            if c == 0:
                if backward:
                    write(stash[s], col["f_slot"][t, s], ("x", m, 0))
            else:
                slot = col["f_slot"][t, s]
                assert stash[s][slot] == ("x", m, c), f"F{(m, c)} at tick {t} reads the wrong input"
                if not backward:
                    stash[s][slot] = None
            if c == chunks - 1 and backward:
                write(inbox[s], col["head_slot"][t, s], ("g", m, c))
            sent_f[s] = ("x", m, c + 1) if c < chunks - 1 else None
        for s in range(stages):
            if col["b_chunk"][t, s] < 0:
                continue
            m, c = int(col["b_mb"][t, s]), int(col["b_chunk"][t, s]) * stages + s
            assert backward and (m, c) in done_f and (m, c) not in done_b
            assert bool(col["b_first"][t, s]) == (c == 0)
            done_b.add((m, c))
            slot, gslot = col["b_slot"][t, s], col["b_inbox"][t, s]
            assert stash[s][slot] == ("x", m, c), f"B{(m, c)} at tick {t} reads the wrong input"
            assert inbox[s][gslot] == ("g", m, c), f"B{(m, c)} at tick {t} reads the wrong grad"
            stash[s][slot] = inbox[s][gslot] = None
            sent_b[s] = ("g", m, c - 1) if c > 0 else None
        for s in range(stages):
            prev, nxt = (s - 1) % stages, (s + 1) % stages
            if col["recv_f"][t, s] >= 0:
                assert sent_f[prev] is not None and (table.virtual > 1 or s > 0)
                write(stash[s], col["recv_f"][t, s], sent_f[prev])
            elif sent_f[prev] is not None and sent_f[prev][2] % stages == s:
                raise AssertionError(f"activation {sent_f[prev]} sent at tick {t} is dropped")
            if col["recv_b"][t, s] >= 0:
                assert sent_b[nxt] is not None and (table.virtual > 1 or s < stages - 1)
                write(inbox[s], col["recv_b"][t, s], sent_b[nxt])
            elif sent_b[nxt] is not None and sent_b[nxt][2] % stages == s:
                raise AssertionError(f"gradient {sent_b[nxt]} sent at tick {t} is dropped")
    expected = {(m, c) for m in range(table.microbatches) for c in range(chunks)}
    assert done_f == expected, "some forward never ran"
    assert done_b == (expected if backward else set()), "some backward never ran"
    assert all(v is None for buf in stash + inbox for v in buf), "a buffer was never read"
