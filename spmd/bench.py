"""`python -m spmd.bench`: steady-state speed of the train step, next to a bare `jax.jit` step.

    python -m spmd.bench --model small --mesh dp=2,tp=4 [--steps 30 --rounds 5 ...]

Takes the same flags as `python -m spmd.train`. Two programs run side by side, in alternating
rounds so machine noise hits both alike:
  spmd: the framework's compiled step fed by its data pipeline (host batch assembly included);
  bare: a hand-written `jax.jit` step of the same math (same model, loss and optax chain, same
        param shardings, a fixed device-resident batch, donated buffers), i.e. zero overhead.
Reports the median step time of each, their ratio, tokens/s, model TFLOP/s and MFU per device
(where the device's peak is known) and compile times.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # the huge-page restart before the imports, as in spmd/train.py
    from spmd.parallel import huge_pages

    huge_pages.restart_early(sys.argv[1:])

import dataclasses
import json
import statistics
import time
import traceback
from typing import Any

import jax
import optax
from flax import nnx

from models import family
from spmd.engine import frozen, optim
from spmd.engine.precision import cast
from spmd.engine.step import Program
from spmd.errors import UsageError, run_command
from spmd.estimate import hlo
from spmd.io import data, tokens
from spmd.log import say
from spmd.parallel import traced_layout
from spmd.parallel.hooks import notes
from spmd.parallel.mesh import format_mesh, setup_mesh
from spmd.run import builder, checks, config, resolve, run_setup
from spmd.run.config import Config


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """How to measure."""

    rounds: int = 5  # alternating timing rounds per program; --steps are split over them
    # also write the result (medians, compile times, or the error that ended the bench) to
    # this JSON file (benchmarks/gpu_check.py reads it)
    json: str = ""


def bare_step_fn(program: Program, tx: Any, loss_fn: Any) -> Any:
    """The reference: value_and_grad + optax update under plain jax.jit, nothing else. Under a
    16-bit policy it is the same mixed-precision math written out: gradients of the 16-bit
    working params, the update applied to the fp32 master weights, the result cast back. A
    LoRA model's frozen base is held fixed (spmd.engine.frozen: no gradient, no update), and
    its adapters' dropout draws the train step's masks, as the framework's step does."""

    policy = program.policy

    def step(params: Any, opt_state: Any, batch: dict) -> tuple:
        trained, fixed = frozen.split(params)

        def loss(p: Any) -> jax.Array:
            return loss_fn(nnx.merge(program.graphdef, frozen.join(p, fixed)), batch)

        with traced_layout.training(optim.update_count(opt_state)):
            value, grads = jax.value_and_grad(loss)(trained)
        if not policy.has_master:
            updates, opt_state = tx.update(grads, opt_state, trained)
            return frozen.join(optax.apply_updates(trained, updates), fixed), opt_state, value
        master, inner = opt_state["master"], opt_state["inner"]
        updates, inner = tx.update(cast(grads, policy.master_dtype), inner, master)
        master = optax.apply_updates(master, updates)
        new = frozen.join(cast(master, policy.param_dtype), fixed)
        return new, {"master": master, "inner": inner}, value

    # The state keeps the shardings it came in with (as the framework's step does); left to
    # XLA, an output may come back sharded otherwise (an MoE router on `expert`), and the
    # compiled step would refuse it on the next call.
    shardings = jax.tree.map(
        lambda a: a.sharding, (program.abstract_params, program.abstract_opt_state)
    )
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, None))


def time_round(run_steps: Any, steps: int) -> float:
    """Seconds per step over `steps` dispatched back to back (one sync at the end)."""
    started = time.perf_counter()
    run_steps(steps)
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    out = json_path(argv)
    try:
        cfg, rounds, steps, compile_s, program, _ = prepare(argv)
        per_round = max(cfg.run.steps // rounds, 1)
        times = time_alternating(steps, rounds, per_round)
    except UsageError:
        raise
    except Exception as e:  # out of memory, a compile error: say it, and exit 1 with a table
        tail = error_tail(e)
        say(f"bench failed: {tail[-1]}\n" + "\n".join(f"  {line}" for line in tail[:-1]))
        write_json(out, {"error": tail})
        return 1
    rows = report(cfg, program, times, compile_s, f"{rounds} rounds x {per_round} steps")
    choices = dict(notes())  # the kernels traced: attention's, the MoE dispatch's
    write_json(out, {**rows, "times_s": times, "compile_s": compile_s, "model_choices": choices})
    return 0


def json_path(argv: list[str] | None) -> str:
    """The --json value of a command line ("" when absent), read before the config is."""
    args = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(args):
        if arg == "--json" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--json="):
            return arg.split("=", 1)[1]
    return ""


def error_tail(error: BaseException, lines: int = 12) -> list[str]:
    """The last `lines` lines of an exception's traceback and message (XLA's out-of-memory
    errors list every buffer: the end names the failure)."""

    text = "".join(traceback.format_exception(error)).rstrip().splitlines()
    # JAX closes its filtered tracebacks with a line of dashes: the message is above it
    return [line for line in text if line.strip(" -")][-lines:]


def write_json(path: str, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def resolve_sections(argv: list[str] | None, prog: str = "python -m spmd.bench") -> dict[str, Any]:
    """The config tree of a bench command line (spmd.run.resolve.run_config's, as spmd.train's
    with the [bench] section): Hub ids resolved (a --tokenizer's: its tokenizer.json), the model
    of --init-from-hf, the base and [lora] section of --init-from-peft."""
    return resolve.run_config(argv, prog, {**resolve.sections(), "bench": BenchConfig})


def prepare(
    argv: list[str] | None, prog: str = "python -m spmd.bench", may_restart: bool | None = None
) -> tuple:
    """(Config, rounds, {name: run n steps}, {name: compile seconds}, Program, the compiled
    train step) of a bench command line: the XLA flags applied, the mesh made, both steps
    compiled. `may_restart`: as spmd.parallel.xla_flags.apply's (a script that is itself a
    benchmark passes True)."""
    sections = resolve_sections(argv, prog)
    cfg, rounds = config.Config.of(sections), sections["bench"].rounds
    if rounds < 1:
        raise UsageError(f"--rounds {rounds} must be a positive number of rounds")
    if cfg.run.epochs or cfg.observe.sample_every:
        flag = "--epochs" if cfg.run.epochs else "--sample-every"
        raise UsageError(f"{flag} is spmd.train's; spmd.bench times --steps steps, leave it out")
    checks.check_choices(cfg)
    from spmd.parallel import xla_flags

    say(
        xla_flags.describe(
            xla_flags.apply(
                cfg.parallel.xla_preset,
                cfg.parallel.bucket_mb,
                cfg.parallel.collectives,
                may_restart,
            )
        )
    )
    mesh = setup_mesh(cfg.parallel.mesh, cfg.parallel.devices)
    return cfg, rounds, *compiled_pair(cfg, mesh)


def compiled_pair(cfg: Config, mesh: Any) -> tuple[dict, dict, Any, Any]:
    """({"spmd": run n steps, "bare": run n steps}, {name: compile seconds}, the Program, its
    compiled train step): the training run's compiled step (spmd.run.builder, as `spmd.train`
    builds it) fed by its data pipeline, and the bare jit step on a fixed device-resident
    batch, each with its own initial state."""

    if cfg.precision.precision == "fp16":
        raise UsageError(
            "--precision fp16 is not benchmarked: its loss scaling has no bare counterpart; "
            "use fp32 or bf16"
        )
    if cfg.parallel.dcn_sync == "diloco":
        raise UsageError(
            "--dcn-sync diloco is not benchmarked: a bare jit step has no outer loop to compare "
            "with; use --dcn-sync every-step"
        )
    program = builder.program(cfg, mesh)
    assert isinstance(program, Program)  # --dcn-sync diloco is refused above
    run_setup.describe_program(cfg, program)  # mesh, batch, precision, pipeline schedule
    if mesh.shape["pipeline"] > 1:
        say(
            "bare: the same math without the pipeline schedule (params in the pipeline's "
            "shardings), a reference for the schedule's cost"
        )
    started = time.perf_counter()
    compiled = program.compile_train_step(cfg.run.batch, cfg.run.seq_len)
    compile_s = {"spmd": time.perf_counter() - started}
    # the same line spmd.train prints: equal fingerprints, the same compiled step
    say(f"train step HLO fingerprint {hlo.fingerprint(compiled)}")
    batch_abstract = program.abstract_batch(cfg.run.batch, cfg.run.seq_len)
    tx = builder.optimizer(cfg)(frozen.trainable(program.names))  # as the engine's: no base
    bare = bare_step_fn(program, tx, builder.run_model(cfg).loss)  # the LoRA model's too
    started = time.perf_counter()
    bare = bare.lower(program.abstract_params, program.abstract_opt_state, batch_abstract).compile()
    compile_s["bare"] = time.perf_counter() - started

    token_file = tokens.open_tokens(cfg.data.data, cfg.data.tokenizer, cfg.data.data_cache)
    windows = data.TokenWindows(token_file.load(), cfg.run.seq_len, 0.0)
    sharding = program.layout.batch_sharding()
    state: dict[str, tuple[Any, Any, Any]] = {"spmd": program.init(), "bare": program.init()}
    fixed_batch = data.global_batch(
        windows, data.train_window_ids(cfg.run.seed, 0, cfg.run.batch, windows.n_train), sharding
    )
    counter = {"step": 0}

    def spmd_steps(n: int) -> None:
        params, opt_state, loss_scale = state["spmd"]
        for _ in range(n):
            ids = data.train_window_ids(
                cfg.run.seed, counter["step"], cfg.run.batch, windows.n_train
            )
            counter["step"] += 1
            batch = data.global_batch(windows, ids, sharding)
            params, opt_state, loss_scale, metrics = compiled(params, opt_state, loss_scale, batch)
        jax.block_until_ready(metrics)
        state["spmd"] = (params, opt_state, loss_scale)

    def bare_steps(n: int) -> None:
        params, opt_state, loss_scale = state["bare"]
        for _ in range(n):
            params, opt_state, loss = bare(params, opt_state, fixed_batch)
        jax.block_until_ready(loss)
        state["bare"] = (params, opt_state, loss_scale)

    return {"spmd": spmd_steps, "bare": bare_steps}, compile_s, program, compiled


def time_alternating(steps: dict[str, Any], rounds: int, per_round: int) -> dict[str, list]:
    """Seconds per step of each program in each round; the programs take turns within every
    round (after two warm-up steps each), so machine noise hits them alike. Each turn starts
    with one untimed step: the first step after another program's turn pays for memory the
    kernel took back meanwhile (on this project's CPU machine 600-750 ms instead of 320 for
    the benchmark model of docs/speed.md), which steady training never pays."""
    for run_steps in steps.values():
        run_steps(2)  # warm-up: first-call allocation and transfer paths
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, run_steps in steps.items():
            run_steps(1)
            times[name].append(time_round(run_steps, per_round))
    return times


def report(cfg: Config, program: Program, times: dict, compile_s: dict, rounds: str) -> dict:
    """The table: median step time, tokens/s, TFLOP/s and MFU per device (model FLOPs, the
    formula the training records use; MFU only where the device's peak is known) and compile
    time of each program, then their ratio. Returns {"median_s", "tflops", "mfu"}, each by
    program (mfu None without a peak)."""

    from spmd.estimate import flops

    mesh = program.layout.mesh
    device_kind = jax.devices()[0].device_kind
    tokens_per_step = cfg.run.batch * cfg.run.seq_len
    model_cfg = cfg.model
    n_params = family.of(model_cfg).n_params(model_cfg)
    flops_per_step = flops.decoder_flops_per_token(model_cfg, cfg.run.seq_len) * tokens_per_step
    peak = flops.peak_tflops(device_kind, cfg.precision.precision, cfg.observe.peak_tflops)
    say(
        f"mesh {format_mesh(dict(mesh.shape))} ({mesh.size} x {device_kind}), "
        f"zero {cfg.parallel.zero}, {cfg.precision.precision}, --collectives "
        f"{cfg.parallel.collectives}, model "
        f"{cfg.run.model} ({n_params / 1e6:.2f} M params), remat {model_cfg.remat}, "
        f"batch {cfg.run.batch} x {cfg.run.seq_len} tokens, {rounds}"
    )
    say(f"{'':6}{'median step':>14}{'tokens/s':>14}{'TFLOP/s':>10}{'MFU':>8}{'compile':>10}")
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows: dict[str, dict] = {"median_s": medians, "tflops": {}, "mfu": {}}
    for name, step_s in medians.items():
        tflops = flops_per_step / step_s / mesh.size / 1e12
        rows["tflops"][name], rows["mfu"][name] = tflops, tflops / peak if peak else None
        mfu = f"{tflops / peak:.1%}" if peak else "-"
        say(
            f"{name:6}{step_s * 1e3:>11.2f} ms{tokens_per_step / step_s:>14,.0f}"
            f"{tflops:>10.2f}{mfu:>8}{compile_s[name]:>8.1f} s"
        )
    say(f"spmd / bare step time: {medians['spmd'] / medians['bare']:.3f}")
    if not peak:
        say(f"MFU: no peak known for {device_kind!r} (--peak-tflops sets one)")
    return rows


if __name__ == "__main__":
    sys.exit(main())
