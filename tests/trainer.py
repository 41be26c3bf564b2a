"""Shared test helper: train the tiny model in-process on a given layout, return the losses."""

from __future__ import annotations

import dataclasses
import functools
import string

import jax
import numpy as np

from models import llama
from spmd.engine import precision
from spmd.engine.options import StepOptions
from spmd.engine.step import Program
from spmd.io import data
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import build_mesh, parse_mesh
from spmd.parallel.pipeline import Pipeline
from spmd.run import builder
from spmd.run.config import build, flat, preset

STEPS = 20
BATCH = 16
SEQ_LEN = 32


@functools.cache
def tiny_config() -> llama.LlamaConfig:
    return build(llama.LlamaConfig, preset("tiny"), "tiny preset")


@functools.cache
def windows(seq_len: int = SEQ_LEN) -> data.TokenWindows:
    """A small deterministic corpus made here (tests need nothing outside the repo)."""
    rng = np.random.default_rng(0)
    words = [
        "".join(rng.choice(list(string.ascii_lowercase), rng.integers(2, 8))) for _ in range(300)
    ]
    text = " ".join(rng.choice(words, 40_000)).encode()
    return data.TokenWindows(np.frombuffer(text, np.uint8).astype(np.uint16), seq_len, 0.05)


def layout(mesh: str, zero: int = 3, devices: int | None = None) -> Layout:
    sizes = parse_mesh(mesh)
    count = devices or int(np.prod([s for s in sizes.values()]))
    return Layout(build_mesh(sizes, jax.devices()[:count]), zero)


def model_spec(**model_overrides: object) -> builder.ModelSpec:
    """The tiny Llama (fields of `model_overrides` changed) as spmd.run.builder builds a family's
    model: its create in fp32, its loss and its layout checks."""
    cfg = dataclasses.replace(tiny_config(), **model_overrides)
    return builder.model_spec(cfg, precision.POLICIES["fp32"])


def program(
    lay: Layout,
    accum: int = 1,
    executor: str = "auto",
    pipeline: Pipeline | None = None,
    prefetch: bool = True,
    spec: builder.ModelSpec | None = None,
    **model_overrides: object,
) -> Program:
    """The tiny model's program on `lay` (`spec`: another model's, e.g. a Gemma's), built by
    spmd.run.builder's road for BATCH x SEQ_LEN batches; `pipeline` pipelines it; `prefetch`
    as StepOptions' (explicit ZeRO-3)."""
    train = flat(None, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, warmup=2, lr=3e-3)
    options = StepOptions(accum=accum, executor=executor, pipeline=pipeline, prefetch=prefetch)
    spec = spec or model_spec(**model_overrides)
    built = builder.build(spec, builder.optimizer(train), lay, options, None, BATCH, SEQ_LEN)
    assert isinstance(built, Program)
    return built


@functools.cache
def compiled(
    mesh: str, zero: int = 3, executor: str = "auto", accum: int = 1, prefetch: bool = True
) -> tuple[Program, object]:
    """(program, AOT-compiled train step for BATCH x SEQ_LEN) of the tiny model on `mesh`,
    made once per test session: the parity, layout and explicit-collective tests share them."""
    prog = program(layout(mesh, zero), accum, executor, prefetch=prefetch)
    return prog, prog.compile_train_step(BATCH, SEQ_LEN)


@functools.cache
def initial_state() -> tuple:
    """(params, opt_state, loss_scale) of the seed-0 init, as host arrays, made once: it does
    not depend on the mesh, and compiling init costs as much as a train step."""
    return jax.device_get(tuple(compiled("dp=1")[0].init()))


def train_metrics(
    prog: Program,
    steps: int = STEPS,
    initial=None,
    step_fn=None,
    batch: int = BATCH,
    seq_len: int = SEQ_LEN,
) -> tuple[dict[str, np.ndarray], dict]:
    """Each step's metrics ({name: [steps]}) of `steps` optimizer steps on `batch` x `seq_len`
    windows, and the final params (as numpy). `initial` (params, opt state, loss scale) from
    another program of the same model skips compiling this one's init; `step_fn` (e.g. an
    AOT-compiled train step) replaces `prog.train_step`."""
    if initial is None:
        params, opt_state, loss_scale = prog.init()
    else:
        params, opt_state, loss_scale = jax.tree.map(
            lambda x, target: jax.device_put(x, target.sharding),
            tuple(initial),
            (prog.abstract_params, prog.abstract_opt_state, prog.abstract_loss_scale),
        )
    win = windows(seq_len)
    history = []
    for step in range(steps):
        ids = data.train_window_ids(0, step, batch, win.n_train)
        batch_arrays = data.global_batch(win, ids, prog.layout.batch_sharding())
        params, opt_state, loss_scale, metrics = (step_fn or prog.train_step)(
            params, opt_state, loss_scale, batch_arrays
        )
        history.append(metrics)
    stacked = jax.tree.map(lambda *values: np.asarray(values), *jax.device_get(history))
    return stacked, jax.device_get(params)


def train_losses(
    prog: Program, steps: int = STEPS, initial=None, step_fn=None, **shape: int
) -> tuple[np.ndarray, dict]:
    """`train_metrics`' losses and final params (`shape`: its batch and seq_len)."""
    metrics, params = train_metrics(prog, steps, initial, step_fn, **shape)
    return metrics["loss"], params


@functools.cache
def losses(
    mesh: str, zero: int = 3, executor: str = "auto", prefetch: bool = True
) -> tuple[np.ndarray, dict]:
    """`train_losses` of the shared compiled program of (mesh, zero, executor) from the shared
    initial state, computed once per test session (the parity and bucketing tests share it)."""
    program, step = compiled(mesh, zero, executor, prefetch=prefetch)
    return train_losses(program, STEPS, initial_state(), step)


def max_relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.abs(b)))


def assert_close_but_sign_flips(
    actual: np.ndarray, expected: np.ndarray, flip: float, rtol: float, atol: float, what: str
) -> None:
    """`actual` equals `expected` within (rtol, atol), except at most one element in a thousand
    (and at least one), each by no more than `flip`: the size of an optimizer update whose
    sign changed (2 x lr x steps). Sign-driven updates (Adam's of a near-zero gradient, every
    one of Lion's) flip where the reduction order changes the last bit of a near-zero value,
    which differs between CPU models; a layout that reduces wrongly differs almost everywhere."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    off = np.abs(actual - expected) > atol + rtol * np.abs(expected)
    allowed = max(1, actual.size // 1000)
    assert off.sum() <= allowed, f"{what}: {off.sum()} of {actual.size} elements differ"
    worst = float(np.max(np.abs(actual - expected)[off], initial=0.0))
    assert worst <= flip, f"{what}: an element differs by {worst:.2e}, over a sign flip's {flip}"
