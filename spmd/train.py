"""`python -m spmd.train`: train the Llama model on any mesh, printing and logging progress.

    python -m spmd.train [--config configs/X.toml] [--model tiny] [--mesh dp=2,tp=4] [...]

The resolved config is printed first; `--dry-run` compiles the step and reports per-device
memory and the compiled collectives without training. User mistakes exit with status 2 and one
line naming the bad value.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from typing import Any

from models import family, llama, moe
from spmd import config
from spmd.checks import (
    batch_arithmetic,
    check_checkpoint_dir,
    check_choices,
    check_dcn_sync_mesh,
    check_sequence_split,
    format_batch_arithmetic,
)
from spmd.config import TrainConfig
from spmd.errors import UsageError
from spmd.io import run_data
from spmd.io.resume import open_checkpoints
from spmd.observe.metrics import MetricsLog, say

# The model section is the Llama's fields plus the experts' (n_experts 0: the dense Llama).
# MoE training knobs that --init-from-hf takes from the flags when given (config.json has none)
ROUTER_KNOBS = ("capacity_factor", "aux_loss_coef", "z_loss_coef")
SECTIONS = {"model": moe.MoEConfig, "train": TrainConfig}


def expand_layout(values: dict[str, Any]) -> dict[str, Any]:
    """A named --layout fills --mesh, --zero (and --sequence-parallel) where not given."""
    if not values.get("layout"):
        return values
    import meshes

    preset = meshes.get(values["layout"])
    sp = {"sequence_parallel": True} if preset.sequence_parallel else {}
    return {"mesh": preset.mesh, "zero": preset.zero, **sp, **values}


def start_processes(train: TrainConfig) -> int:
    """Join the multi-process job if this is one (flags, spmd.launch, SLURM, Open MPI);
    only process 0 prints progress and writes metrics. Returns the number of processes."""
    from spmd.observe.metrics import set_primary
    from spmd.parallel import distributed

    n_processes = distributed.initialize(
        train.coordinator,
        train.num_processes,
        train.process_id,
        auto_detect=distributed.cluster_detected(),
    )
    set_primary(distributed.process_id() == 0)
    return n_processes


def pipeline_of(train: TrainConfig, model: llama.LlamaConfig, layout: Any) -> tuple:
    """(spmd.parallel.pipeline.Pipeline, its schedule report) when the mesh has pp > 1, else (None,
    None); prints the schedule's bubble and idle share. UsageError for a schedule that cannot
    run (layers, micro-batches or batch that do not split)."""
    stages = layout.mesh.shape["pipeline"]
    if stages == 1:
        return None, None
    from spmd.parallel import pipeline

    pipe = pipeline.Pipeline(
        train.pp_schedule, train.microbatches, train.pp_virtual, llama.logits_loss
    )
    pipeline.check(pipe, layout, model.n_layers, train.batch, train.accum)
    report = pipeline.report(pipeline.with_accumulation(pipe, stages, train.accum), stages)
    say(
        f"pipeline: {report['schedule']} over {stages} stages x {report['virtual']} chunks, "
        f"{report['microbatches']} micro-batches | bubble (p-1)/(M+p-1)/v "
        f"{report['bubble_theory']:.3f} | idle share of the tick table run "
        f"{report['idle_fraction']:.3f} ({report['ticks']} ticks, {report['stash_slots']} "
        f"stashed inputs per stage)"
    )
    return pipe, report


def main(argv: list[str] | None = None) -> int:
    from spmd.parallel import distributed

    try:
        code = run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except BaseException:
        if distributed.num_processes() == 1:
            raise
        traceback.print_exc()
        code = 1
    if distributed.num_processes() > 1 and code:
        # A failing process must not wait in JAX's shutdown barrier for peers that may never
        # arrive (that would hang the job): leave now; spmd.launch stops the others.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run(argv: list[str] | None) -> int:
    sections = resolve_sections(argv)
    train, model_cfg = sections["train"], sections["model"]
    check_choices(train, model_cfg)
    run_data.check_choices(train)
    from spmd.parallel import xla_flags

    flags = xla_flags.apply(train.xla_preset, train.bucket_mb, train.collectives)  # before JAX
    n_processes = start_processes(train)
    say(config.format_config(sections))
    say(xla_flags.describe(flags))
    checkpointing = bool(train.checkpoint_dir) and not train.dry_run
    if checkpointing:
        check_checkpoint_dir(train)
    token_file, windows = run_data.open_run_data(train, model_cfg.vocab_size)
    eval_sets = run_data.open_eval_sets(train, model_cfg.vocab_size, windows)
    from spmd.parallel.mesh import setup_mesh

    mesh = setup_mesh(train.mesh, train.devices, train.dcn_mesh, n_processes)
    check_dcn_sync_mesh(train, mesh, n_processes)
    program, pipe_report, with_lr_factor = build_run_program(train, model_cfg, mesh, windows)
    manager, restored = None, None
    if checkpointing:
        manager, restored = open_checkpoints(train, program, sections, token_file.fingerprint)
    from spmd.engine.divergence import Guard

    guard = Guard(train, restored.data if restored is not None else None)
    if guard.lr_factor != 1.0:  # earlier rollbacks lowered the LR: go on with it
        say(f"LR x{guard.lr_factor:g} after {guard.rollbacks} rollback(s), as saved")
        program = with_lr_factor(guard.lr_factor)
    compiled, facts = compile_step(train, model_cfg, program)
    facts["xla_flags"] = flags
    if train.dry_run:
        report_dry_run(train, model_cfg, program, compiled, facts, pipe_report)
        return 0
    log = MetricsLog(train.metrics, append=restored is not None, tensorboard=train.tensorboard)
    write_config_record(log, sections, program, facts, pipe_report)
    from spmd.engine.loop import Run

    def recompile(lr_factor: float) -> Any:
        return with_lr_factor(lr_factor).compile_train_step(train.batch, train.seq_len)

    def make_run(stop: Any) -> Run:
        return Run(
            train=train,
            sections=sections,
            program=program,
            compiled=compiled,
            log=log,
            windows=windows,
            token_file=token_file,
            manager=manager,
            stop=stop,
            observer=facts["observer"],
            guard=guard,
            recompile=recompile,
            eval_sets=eval_sets,
        )

    return train_until_stopped(make_run, restored, closing=(manager, log))


def report_dry_run(
    train: TrainConfig, model_cfg: Any, program: Any, compiled: Any, facts: dict, pipe_report: Any
) -> None:
    """What `--dry-run` prints after compiling: the state bytes against the ZeRO formula, the
    compiled collectives against theory, the gradient reductions and the memory report."""
    from spmd.estimate import hlo, measure, theory
    from spmd.observe.observer import dry_run_report

    mesh = program.layout.mesh
    say(measure.state_against_formula(train, model_cfg, dict(mesh.shape), facts["state_bytes"]))
    shape = family.of(model_cfg).shape(model_cfg)
    if train.dcn_sync != "diloco":  # DiLoCo's cross-host bytes were printed at compile
        say(theory.report(program, compiled, shape, train.batch, train.seq_len, pipe_report))
    say(hlo.format_grad_reductions(hlo.collectives(compiled, mesh)))
    say(dry_run_report(facts["observer"], compiled, facts["device_kind"]))


def train_until_stopped(make_run: Any, restored: Any, closing: tuple[Any, MetricsLog]) -> int:
    """Train the spmd.engine.loop.Run that `make_run(stop signals)` makes from the restored
    checkpoint (or the start) to the end or a stop; the exit status. `closing` (the checkpoint
    manager or None, the metrics log) are closed after the last save is written."""
    from spmd.engine.loop import train_loop
    from spmd.io.preemption import StopSignals

    # Open until the last save is written: a stop signal during the final eval or save is noted
    # (and the run ends as planned) instead of killing the process mid-save.
    manager, log = closing
    with StopSignals() as stop:
        try:
            loop_run = make_run(stop)
            start = initial_state(loop_run, restored)
            return 0 if start is None else train_loop(loop_run, *start)
        finally:
            if manager is not None:
                manager.close()  # waits for a save still being written
            log.close()


def resolve_sections(argv: list[str] | None) -> dict[str, Any]:
    """The config tree of the command line; with --init-from-hf the Hugging Face folder's
    config.json is the architecture."""
    sections = config.resolve(argv, SECTIONS, "python -m spmd.train", expand_train=expand_layout)
    if sections["train"].init_from_hf:
        from models import hf_llama

        folder = hf_llama.open_checkpoint(sections["train"].init_from_hf, sections["model"].remat)
        # The architecture is the folder's; the router's training knobs given as flags win.
        given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}
        knobs = {
            name: getattr(sections["model"], name)
            for name in ROUTER_KNOBS
            if config.flag_name(name) in given and hasattr(folder.config, name)
        }
        sections["model"] = dataclasses.replace(folder.config, **knobs)
    return sections


def build_run_program(
    train: TrainConfig, model_cfg: llama.LlamaConfig, mesh: Any, windows: Any
) -> tuple:
    """(the Program of this run on `mesh`, the pipeline schedule report or None, lr_factor ->
    the same Program with its LR schedule x lr_factor), printing the mesh, the batch arithmetic
    and the precision policy."""
    import jax

    from spmd import api
    from spmd.engine import precision
    from spmd.engine.optim import make_optimizer
    from spmd.engine.step import Layout, check_batch
    from spmd.parallel.mesh import format_mesh

    layout = Layout(mesh, train.zero)
    check_batch(train.batch, layout, train.accum)
    check_sequence_split(
        train.seq_len,
        dict(mesh.shape),
        train.sequence_parallel,
        moe=bool(family.of(model_cfg).shape(model_cfg).n_experts),
        document_mask="segments" in windows.fields,
    )
    policy = precision.get(train.precision, train.grad_reduce)
    say(
        f"mesh {format_mesh(dict(mesh.shape))} ({mesh.size} x {jax.devices()[0].device_kind}), "
        f"zero {train.zero} | {model_cfg.n_params() / 1e6:.2f} M params | "
        f"{format_batch_arithmetic(batch_arithmetic(train, layout.data_parallel))}"
    )
    say(precision.describe(policy))
    pipe, pipe_report = pipeline_of(train, model_cfg, layout)
    moe.check_layout(model_cfg, layout.mesh, train.collectives)

    def with_lr_factor(lr_factor: float) -> Any:
        # Rollbacks lower the LR; the schedule is part of the compiled step, so it is rebuilt.
        scaled = dataclasses.replace(train, lr=train.lr * lr_factor)
        make_model = lambda seed: moe.create(model_cfg, seed, policy.compute_dtype)  # noqa: E731
        if train.dcn_sync == "diloco":
            from spmd.engine import diloco

            tx = lambda names: make_optimizer(scaled, names)  # noqa: E731
            program = diloco.from_config(train, make_model, moe.lm_loss, tx, layout)
            program.inner.batch_fields = windows.fields
            return program
        program = api.build(
            make_model,
            moe.lm_loss,
            lambda names: make_optimizer(scaled, names),
            mesh,
            zero_stage=train.zero,
            executor=train.collectives,
            precision_policy=train.precision,
            grad_reduce=train.grad_reduce,
            accum=train.accum,
            seed=train.seed,
            pipeline=pipe,
            sequence_parallel=train.sequence_parallel,
            bucket_mb=train.bucket_mb,
            prefetch=train.prefetch,
        )
        program.batch_fields = windows.fields  # segment ids, loss weights: as the data has
        return program

    return with_lr_factor(1.0), pipe_report, with_lr_factor


def compile_step(train: TrainConfig, model_cfg: llama.LlamaConfig, program: Any) -> tuple:
    """(the compiled train step, what the config record and dry run report of it), printing the
    compile time and per-device memory."""
    import jax

    from spmd.engine.state_layout import state_bytes_per_device
    from spmd.estimate import hlo
    from spmd.observe.observer import make_observer, model_metrics

    started = time.perf_counter()
    compiled = program.compile_train_step(train.batch, train.seq_len)
    compile_s = time.perf_counter() - started
    state_bytes = state_bytes_per_device(compiled, program)
    memory = hlo.memory(compiled)
    say(
        f"compiled the train step in {compile_s:.1f} s | per device: params "
        f"{state_bytes['params'] / 2**20:.2f} MiB, optimizer state "
        f"{state_bytes['opt_state'] / 2**20:.2f} MiB, temp {memory.get('temp', 0) / 2**20:.2f} "
        f"MiB with --remat {model_cfg.remat} (activations kept for the backward pass)"
    )
    from spmd.parallel.hooks import notes

    say(f"model choices while tracing: {notes() or 'none'}")  # e.g. the attention kernel
    facts = {
        "model_notes": notes(),
        "compile_s": compile_s,
        "state_bytes": state_bytes,
        "memory": memory,
        "device_kind": jax.devices()[0].device_kind,
        "observer": make_observer(train, model_cfg, program.layout.mesh, compiled),
    }
    if family.of(model_cfg).shape(model_cfg).n_experts:  # the router's statistics in each record
        facts["observer"].model_metrics = model_metrics(program, moe.router_stats)
    if train.dcn_sync == "diloco":
        from spmd.estimate import dcn_traffic

        facts["dcn_traffic"] = dcn_traffic.traffic(program, compiled)
        say(dcn_traffic.format_traffic(facts["dcn_traffic"]))
    return compiled, facts


def write_config_record(
    log: MetricsLog, sections: dict[str, Any], program: Any, facts: dict, pipe_report: Any
) -> None:
    """The first JSONL record: the resolved config, the mesh and what the compile found."""
    import jax

    from spmd.parallel.mesh import format_mesh

    train, model_cfg, mesh = sections["train"], sections["model"], program.layout.mesh
    log.write(
        "config",
        config=config.as_dict(sections),
        mesh=dict(mesh.shape),
        mesh_text=format_mesh(dict(mesh.shape)),
        devices=mesh.size,
        device_kind=facts["device_kind"],
        platform=jax.devices()[0].platform,
        n_params=model_cfg.n_params(),
        state_bytes_per_device=facts["state_bytes"],
        compile_s=facts["compile_s"],
        flops_per_step=facts["observer"].flops_per_step,
        peak_tflops_per_device=facts["observer"].peak,
        memory_per_device=facts["memory"],
        batch_arithmetic=batch_arithmetic(train, program.layout.data_parallel),
        pipeline=pipe_report,
        dcn_traffic=facts.get("dcn_traffic"),  # --dcn-sync diloco: cross-host bytes per step
        xla_flags=facts.get("xla_flags"),
        model_notes=facts["model_notes"],
    )


def initial_state(run: Any, restored: Any) -> tuple[dict[str, Any], int] | None:
    """(state, first step) to train from: the restored checkpoint's, the Hugging Face
    weights of --init-from-hf, or a fresh init; None when the checkpoint already completes
    --steps."""
    train, program = run.train, run.program
    if restored is not None:
        run.log.write("resume", step=restored.step, checkpoint_dir=train.checkpoint_dir)
        if restored.step >= train.steps:
            say(f"the checkpoint at step {restored.step} already completes --steps {train.steps}")
            return None
        return program.from_checkpoint(restored.state)._asdict(), restored.step + 1
    if train.init_from_hf:
        from spmd.weights import init_from_hf

        params, opt_state, loss_scale = init_from_hf(train.init_from_hf, program)
    else:
        params, opt_state, loss_scale = program.init()
    return {"params": params, "opt_state": opt_state, "loss_scale": loss_scale}, 1


if __name__ == "__main__":
    sys.exit(main())
