"""`python -m spmd.bench_collectives`: step time of the auto vs the explicit executor, per layout.

    python -m spmd.bench_collectives [--model tiny] [--batch 16] [--seq-len 128] [--steps 30]
                                     [--devices 8] [--layouts ddp,zero3,...]
                                     [--compare-bucket-mb 0.25,1,4,25]
                                     [--compare-prefetch --remat full]

For each named layout of meshes/ (on --devices simulated CPU devices, or the accelerators
present) both executors' train steps are compiled with the same model, batch and initial
state, then run alternately, step by step, so that both see the same machine noise. Printed:
median step time of each (ms), explicit / auto, and the collective bytes per device of each
compiled step. With --compare-bucket-mb the explicit executor's step is compiled once per
bucket size instead (training's --bucket-mb, spmd.parallel.buckets) and those run
alternately: median step time per bucket size side by side, with the number of gradient
reductions each compiled step holds. The XLA flags of the largest bucket size are set first
(spmd.parallel.xla_flags: on CPU that turns XLA's all-reduce combiner off, so bucket size 0
there means one all-reduce per param). With --compare-prefetch the explicit step is compiled
with ZeRO-3's prefetching layer scan off and on (training's --prefetch,
spmd.parallel.layer_scan) for the layouts with ZeRO-3 and those run alternately: median step
time and the all-gathers per step of each (prefetch needs rematerialised layers: --remat full
or dots_saveable). A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
import types
from typing import Any, Literal

from spmd.errors import UsageError, run_command
from spmd.model_shape import Remat
from spmd.sections import MeshConfig, RunConfig


@dataclasses.dataclass(frozen=True)
class CollectivesBenchConfig:
    """What to compare. The model, batch, steps and devices are training's flags (`run` and
    `mesh` sections), with this benchmark's own defaults (DEFAULTS)."""

    layouts: str = ""  # comma-separated layout presets (meshes/; default: all)
    remat: Literal["", Remat] = ""  # --remat (empty: the preset's)
    # comma-separated gradient bucket sizes in MiB (--bucket-mb of each explicit step), compared
    compare_bucket_mb: str = ""
    compare_prefetch: bool = False  # explicit ZeRO-3: the step with --prefetch false vs true


# The training flags this benchmark takes (their meaning, type and help are training's).
RUN_FIELDS = ("model", "steps", "batch", "seq_len")
# Its own defaults of them: a small model, quick to compile per layout and executor, timed
# over 30 steps (--steps: the timed steps per executor), on 8 simulated CPU devices.
DEFAULTS = {"model": "tiny", "steps": 30, "batch": 16, "seq_len": 128, "devices": 8}


def parse_args(argv: list[str] | None) -> Any:
    """The resolved flags of every section, flat (`args.batch`, `args.layouts`)."""
    from spmd.run import config
    from spmd.run.section_views import view

    sections = {
        "bench": CollectivesBenchConfig,
        "run": view(RunConfig, RUN_FIELDS),
        "mesh": view(MeshConfig, ("devices",)),
    }
    about = __doc__.split("\n\n")[0]
    prog = "python -m spmd.bench_collectives"
    resolved = config.resolve(argv, sections, prog, defaults=DEFAULTS, description=about)
    return types.SimpleNamespace(**config.flat_values(config.as_dict(resolved)))


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda args: run(parse_args(args)), argv)


def run(args: Any) -> int:
    import meshes
    from spmd.engine.step import EXECUTORS
    from spmd.parallel import mesh as mesh_lib

    names = [n for n in args.layouts.split(",") if n] or list(meshes.presets())
    presets = [meshes.get(n) for n in names]
    check_args(args)
    buckets = _bucket_sizes(args.compare_bucket_mb)
    if buckets:
        from spmd.parallel import xla_flags

        print(xla_flags.describe(xla_flags.apply("throughput", max(buckets), "explicit")))
    if mesh_lib.cpu_only():
        mesh_lib.simulate_cpu_devices(args.devices)

    import jax

    if buckets and args.compare_prefetch:
        raise UsageError(
            "--compare-bucket-mb and --compare-prefetch are separate comparisons; give one of them"
        )
    if buckets:
        return run_buckets(args, presets, buckets)
    if args.compare_prefetch:
        return run_prefetch(args, presets)

    print(
        f"{'layout':<9}{'mesh':<20}{'auto ms':>9}{'explicit ms':>13}{'ratio':>7}"
        f"{'auto bytes':>13}{'explicit bytes':>16}"
    )
    for preset in presets:
        sizes = mesh_lib.resolve_mesh(mesh_lib.parse_mesh(preset.mesh), len(jax.devices()))
        measured = bench_layout(args, sizes, preset.zero, preset.sequence_parallel)
        times, volume = measured["times"], measured["volume"]
        auto, explicit = (statistics.median(times[e]) * 1e3 for e in EXECUTORS)
        print(
            f"{preset.name:<9}{mesh_lib.format_mesh(sizes):<20}{auto:>9.1f}{explicit:>13.1f}"
            f"{explicit / auto:>7.2f}{_mib(volume['auto']):>13}{_mib(volume['explicit']):>16}",
            flush=True,
        )
    return 0


def check_args(args: Any) -> None:
    """UsageError for counts below 1 and a model preset or --remat the family refuses, before
    any device work (--devices 0 would simulate no device at all)."""
    from models import family
    from spmd.run import config

    for name in ("steps", "batch", "seq_len", "devices"):
        if getattr(args, name) < 1:
            raise UsageError(f"{config.flag_name(name)} {getattr(args, name)} must be at least 1")
    values = config.preset(args.model)
    model = config.build(family.check_fields(values, args.model), values, args.model)
    family.of(model).check(dataclasses.replace(model, remat=args.remat or model.remat))


def _bucket_sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise UsageError(
            f"--compare-bucket-mb {text!r} should be sizes in MiB such as 0.25,1,4"
        ) from None
    if not all(0 <= s < math.inf for s in sizes):  # NaN fails every comparison
        raise UsageError(
            f"--compare-bucket-mb {text!r}: sizes must be 0 (one per param) or positive"
        )
    return sizes


def run_buckets(args: Any, presets: list, buckets: list[float]) -> int:
    """The explicit step per bucket size, per layout: median ms and gradient reductions."""
    variants = {f"{b:g} MiB": {"collectives": "explicit", "bucket_mb": b} for b in buckets}
    return run_variants(args, presets, variants, "reductions", "gradient reductions")


def run_prefetch(args: Any, presets: list) -> int:
    """The explicit ZeRO-3 step with the prefetching layer scan off and on, per layout whose
    fsdp axis gathers layers: median ms and all-gathers per step."""
    variants = {
        f"prefetch {int(on)}": {"collectives": "explicit", "prefetch": bool(on)} for on in (0, 1)
    }
    gathering = [p for p in presets if p.zero == 3 and "fsdp" in p.mesh]
    return run_variants(args, gathering, variants, "gathers", "all-gathers")


def run_variants(args: Any, presets: list, variants: dict, count: str, counted: str) -> int:
    """Per layout, the steps of `variants` ({name: spmd.sections.ParallelConfig fields}) run
    alternately:
    median ms per step and `count` (a measure of bench_layout's) per step of each."""
    import jax

    from spmd.parallel import mesh as mesh_lib

    heads = "".join(f"{name:>20}" for name in variants)
    print(f"{'layout':<9}{'mesh':<20}{heads}   (median ms per step / {counted} per step)")
    for preset in presets:
        sizes = mesh_lib.resolve_mesh(mesh_lib.parse_mesh(preset.mesh), len(jax.devices()))
        measured = bench_layout(args, sizes, preset.zero, preset.sequence_parallel, variants)
        cells = "".join(
            f"{statistics.median(measured['times'][k]) * 1e3:>12.1f} / {measured[count][k]:<5}"
            for k in variants
        )
        print(f"{preset.name:<9}{mesh_lib.format_mesh(sizes):<20}{cells}", flush=True)
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def bench_layout(
    args: Any,
    sizes: dict[str, int],
    zero: int,
    sequence_parallel: bool = False,
    variants: dict | None = None,
):
    """Per measure, {variant: value}: "times" [step seconds], "volume" collective bytes per
    device per step, "reductions" gradient reductions (all-reduces / reduce-scatters run once
    per step on more than a scalar), "gathers" all-gathers per step. `variants`: {name:
    spmd.sections.ParallelConfig fields}; default: the two executors. Each variant's Program is
    spmd.run.builder's, as `spmd.train` builds it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import family
    from spmd.engine.step import EXECUTORS, Program
    from spmd.estimate import hlo
    from spmd.parallel.mesh import build_mesh, format_mesh
    from spmd.run import builder, config

    values = config.preset(args.model)
    model = config.build(family.check_fields(values, args.model), values, args.model)
    if args.remat:
        model = dataclasses.replace(model, remat=args.remat)
    base = config.flat(
        model,
        model=args.model,
        batch=args.batch,
        seq_len=args.seq_len,
        mesh=format_mesh(sizes),
        zero=zero,
        sequence_parallel=sequence_parallel,
    )
    mesh = build_mesh(sizes)
    layout = builder.layout_of(base, mesh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (args.batch, args.seq_len + 1), dtype=np.int32)
    batch = {
        "inputs": jax.device_put(tokens[:, :-1], layout.batch_sharding()),
        "targets": jax.device_put(tokens[:, 1:], layout.batch_sharding()),
    }
    variants = variants or {e: {"collectives": e} for e in EXECUTORS}
    steps: dict[str, jax.stages.Compiled] = {}
    states: dict[str, Any] = {}
    volume, reductions, gathers = {}, {}, {}
    for name, keywords in variants.items():
        cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **keywords))
        program = builder.program(cfg, mesh)
        assert isinstance(program, Program)  # the presets sync every step (no DiLoCo pair)
        steps[name] = program.compile_train_step(args.batch, args.seq_len)
        colls = hlo.collectives(steps[name], layout.mesh)
        volume[name] = sum(row["bytes"] for row in hlo.collective_summary(colls).values())
        reductions[name] = len(hlo.grad_reductions(colls))
        gathers[name] = sum(c.count for c in colls if c.kind == "all-gather")
        # One initial state for all (same shardings); copies, since each step donates its own.
        first = next(iter(states.values()), None)
        states[name] = jax.tree.map(jnp.copy, first) if first else program.init()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.steps + 2):  # the first two steps warm up
        for name in variants:
            started = time.perf_counter()
            *state, metrics = steps[name](*states[name], batch)
            jax.block_until_ready(metrics)
            if i >= 2:
                times[name].append(time.perf_counter() - started)
            states[name] = tuple(state)
    return {"times": times, "volume": volume, "reductions": reductions, "gathers": gathers}


if __name__ == "__main__":
    sys.exit(main())
