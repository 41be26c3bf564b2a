"""`python -m spmd.train`: train the Llama model on any mesh, printing and logging progress.

    python -m spmd.train [--config configs/X.toml] [--model tiny] [--mesh dp=2,tp=4] [...]

What the config changes from the defaults is printed first (the whole config is in the run
folder's config.toml); `--dry-run` compiles the step and reports per-device
memory and the compiled collectives without training. User mistakes exit with status 2 and one
line naming the bad value.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # On a CPU this command restarts itself once for glibc's huge-page tunable: here, before
    # JAX and Flax are imported, that costs an interpreter start, not 1.5-2.5 s of imports
    # (spmd.parallel.huge_pages).
    from spmd.parallel import huge_pages

    huge_pages.restart_early(sys.argv[1:])

import time
import traceback
from typing import TYPE_CHECKING, Any

import jax

from models import family
from spmd import reference_cache
from spmd.engine import offload
from spmd.engine.diloco import Compiled, DilocoProgram
from spmd.engine.state_layout import state_bytes_per_device
from spmd.errors import UsageError, end_process, leave, run_command
from spmd.estimate import hlo
from spmd.io import run_data
from spmd.log import (
    close_rank_file,
    say,
    set_level,
    set_primary,
    survive_a_lost_console,
    to_rank_file,
    warn,
)
from spmd.observe.metrics import MetricsLog
from spmd.parallel.hooks import notes
from spmd.parallel.mesh import format_mesh, setup_mesh
from spmd.run import builder, config, resolve, run_setup, samples
from spmd.run.checks import (
    batch_arithmetic,
    check_choices,
    check_dcn_sync_mesh,
    check_paths,
    checkpoint_resumes,
    step_memory_error,
)
from spmd.run.config import Config
from spmd.training import claims, run_folder
from spmd.training.resume import open_checkpoints, with_saved_template

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyCompiled, AnyProgram
    from spmd.training.loop import Run


def start_processes(cfg: Config) -> int:
    """Join the multi-process job if this is one (flags, spmd.launch, or a cluster that JAX's
    own detection finds: spmd.parallel.distributed); only process 0 prints progress and writes
    metrics. Returns the number of processes."""
    from spmd.parallel import distributed

    run = cfg.run
    n_processes = distributed.initialize(
        run.coordinator,
        run.num_processes,
        run.process_id,
        run.coordinator_timeout,
        run.peer_timeout,
    )
    set_primary(distributed.process_id() == 0)
    return n_processes


def main(argv: list[str] | None = None) -> int:
    from spmd.parallel import distributed

    try:
        code = run_command(run, argv)
    except BaseException:
        if distributed.num_processes() == 1:
            raise
        traceback.print_exc()
        code = 1
    if distributed.num_processes() > 1 and code:
        # A failing process must not wait in JAX's shutdown barrier for peers that may never
        # arrive (that would hang the job): leave now; spmd.launch stops the others.
        leave(code)
    return code


def run(argv: list[str] | None) -> int:
    sections = resolve_sections(argv)
    cfg = Config.of(sections)
    if sections["print_config"]:  # the config as resolved, before any check or device work
        print(config.format_config(cfg.sections()))
        return 0
    from spmd.training.preemption import StopSignals

    check_choices(run_folder.with_paths(cfg, run_folder.planned_folder(cfg, "stamp")))
    # From here to the last save a first SIGTERM / SIGINT is noted, never fatal: during start-up
    # and compile it ends the run before its first step (nothing trained, nothing lost); later
    # every process stops after one agreed step and saves it (spmd.training.job).
    with StopSignals() as signals:
        set_level(cfg.observe.log_level)
        try:
            return start_and_train(cfg, signals)
        except UsageError as e:  # the run folder's log says why the run ended (exit 2)
            to_rank_file(f"error: {e}")
            raise
        except KeyboardInterrupt:  # a second SIGINT before the run folder was open
            return stopped_at_once(cfg.checkpoint.checkpoint_dir)
        finally:  # the process may go on (a notebook, the tests): as it was before the run
            claims.release()  # the folder locks, after the last save was written
            close_rank_file()
            set_level("info")


def start_and_train(cfg: Config, signals: Any) -> int:
    """Join the job, open the data, build and compile the program, restore, and train to the
    end or an agreed stop; the exit status."""
    from spmd.parallel import xla_flags

    p = cfg.parallel
    flags = xla_flags.apply(p.xla_preset, p.bucket_mb, p.collectives)  # before JAX starts
    n_processes = start_processes(cfg)
    rerun_text = config.format_config(run_folder.rerun_config(cfg).sections())
    # one folder per run, its log files; it and the checkpoint folder checked and locked first
    asked, (cfg, folder) = cfg, run_folder.open_folder(cfg, rerun_text, claims.claim)
    say(run_setup.describe_config(asked, folder))  # its whole config is in the folder
    say(xla_flags.describe(flags))
    try:
        return train_in_folder(
            cfg, folder, signals, (n_processes, flags), asked.observe.tensorboard
        )
    except KeyboardInterrupt:  # a second SIGINT: the run ends at once (its save given up)
        return stopped_at_once(cfg.checkpoint.checkpoint_dir)


def stopped_at_once(checkpoint_dir: str) -> int:
    """Say in one line that a second SIGINT ended the run (the save it cut short, the step a
    resume continues from); the exit status, 130."""
    from spmd.training.preemption import INTERRUPTED_EXIT, interrupted_line

    try:
        line = interrupted_line(checkpoint_dir)
    except OSError:  # the checkpoint folder cannot be listed now
        line = f"SIGINT again: stopped at once; see {checkpoint_dir} for the steps saved"
    print(line, file=sys.stderr, flush=True)
    to_rank_file(line)
    return INTERRUPTED_EXIT


def train_in_folder(
    cfg: Config, folder: str | None, signals: Any, job: tuple[int, Any], given_tensorboard: str
) -> int:
    """From the run folder, open and locked, to the end of training: the exit status. `job`:
    the number of processes and the XLA flags set (for the config record)."""
    p, (n_processes, flags) = cfg.parallel, job
    check_paths(cfg)  # the run folder's paths, now that its name is agreed
    samples.check(cfg, folder)  # --sample-every writes into the run folder
    checkpointing = bool(cfg.checkpoint.checkpoint_dir) and not cfg.run.dry_run
    resumes = checkpointing and checkpoint_resumes(cfg)
    if resumes:  # the chat template it was trained with, before its data is read
        cfg = with_saved_template(cfg)
    vocab, seq_len = cfg.model.vocab_size, cfg.run.seq_len
    token_file, windows = run_data.open_run_data(cfg.data, seq_len, cfg.run.batch, vocab)
    cfg = resolve.with_epochs(cfg, windows)  # --epochs: the steps its windows make
    eval_sets = run_data.open_eval_sets(cfg.data, seq_len, vocab, windows)
    # --dpo-precompute-reference: pair batches carry the reference's log-probs (filled before
    # the first step, spmd.reference_cache)
    windows = reference_cache.mark(cfg, windows)
    eval_sets = {name: reference_cache.mark(cfg, found) for name, found in eval_sets.items()}
    from spmd.training.evaluation import check_eval_batches

    check_eval_batches(cfg.data.eval_batches, {"held-out": windows, **eval_sets})
    harness_tasks = None
    if cfg.data.eval_harness_every and not cfg.run.dry_run:  # its tasks checked before the mesh
        from spmd.run import lm_eval_bridge

        harness_tasks = lm_eval_bridge.training_tasks(cfg.data)

    mesh = setup_mesh(p.mesh, p.devices, p.dcn_mesh, n_processes)
    check_dcn_sync_mesh(cfg, mesh, n_processes)
    program = builder.program(cfg, mesh, windows.fields)
    pipe_report = run_setup.describe_program(cfg, program)
    manager, restored = None, None
    if checkpointing:
        manager, restored = open_checkpoints(cfg, program, token_file.fingerprint, resumes)
    from spmd.training.divergence import Guard

    saved = restored.data if restored is not None else None
    guard = Guard(cfg.divergence, cfg.precision.precision, saved)
    if guard.lr_factor != 1.0:  # earlier rollbacks lowered the LR: go on with it
        say(f"LR x{guard.lr_factor:g} after {guard.rollbacks} rollback(s), as saved")
        program = builder.program(cfg, mesh, windows.fields, lr_factor=guard.lr_factor)
    compiled, facts = compile_step(cfg, program)
    facts["xla_flags"] = flags
    too_big = step_memory_error(cfg, facts, mesh)  # before anything is allocated for it
    if too_big and not cfg.run.dry_run:
        raise UsageError(too_big)
    if cfg.run.dry_run:  # a dry run allocates nothing: it reports, and warns when it would not fit
        report_dry_run(cfg, program, compiled, facts, pipe_report)
        if too_big:
            warn(f"warning: {too_big}")
        return 0
    if signals.received and n_processes == 1:  # several processes stop together in the loop
        say(f"{signals.received} before the first step: stopping; nothing was trained or saved")
        if manager is not None:
            manager.close()
        return 0
    log = MetricsLog(
        cfg.observe.metrics,  # this run's (spmd.training.claims): never truncated, appended to
        append=restored is not None or claims.holds_records(cfg.observe.metrics),
        trackers=run_folder.trackers_of(cfg, folder, require_tensorboard=bool(given_tensorboard)),
    )
    write_config_record(log, cfg, program, facts, pipe_report)
    sampler, harness_eval = run_setup.watchers(cfg, program, folder, log, harness_tasks)
    from spmd.parallel import distributed
    from spmd.training.job import Heartbeat
    from spmd.training.loop import Run

    def recompile(lr_factor: float) -> Any:
        rebuilt = builder.program(cfg, mesh, windows.fields, lr_factor=lr_factor)
        return rebuilt.compile_train_step(cfg.run.batch, cfg.run.seq_len)

    def make_run(stop: Any) -> Run:
        return Run(
            cfg=cfg,
            program=program,
            compiled=compiled,
            log=log,
            windows=windows,
            token_file=token_file,
            manager=manager,
            stop=stop,
            heartbeat=Heartbeat(distributed.process_id()),
            observer=facts["observer"],
            guard=guard,
            recompile=recompile,
            eval_sets=eval_sets,
            sampler=sampler,
            harness_eval=harness_eval,
        )

    return train_until_stopped(make_run, restored, signals, closing=(manager, log))


def report_dry_run(
    cfg: Config, program: AnyProgram, compiled: AnyCompiled, facts: dict, pipe_report: Any
) -> None:
    """What `--dry-run` prints after compiling: the state bytes against the ZeRO formula, the
    compiled collectives against theory, the gradient reductions and the memory report."""
    from spmd import lora_base
    from spmd.estimate import dry_run_table, hlo, measure
    from spmd.observe.observer import dry_run_report

    mesh = program.layout.mesh
    model_cfg = cfg.model
    say(
        measure.state_against_formula(
            cfg.run,
            cfg.parallel.zero,
            cfg.precision,
            model_cfg,
            dict(mesh.shape),
            facts["state_bytes"],
            facts["state_bytes_by_memory"],
            cfg.parallel.offload,
            lora_base.planner_fields(model_cfg, cfg.lora),
            cfg.optimizer,
            cfg.preference.dpo_precompute_reference,
        )
    )
    shape = family.of(model_cfg).shape(model_cfg)
    if cfg.parallel.dcn_sync != "diloco":  # DiLoCo's cross-host bytes were printed at compile
        run = cfg.run
        say(dry_run_table.report(program, compiled, shape, run.batch, run.seq_len, pipe_report))
    if program.policy.fp8 is not None and program.policy.fp8.all_gather:
        say(measure.fp8_gather_line(program, shape, cfg.run.batch, cfg.run.seq_len))
    say(hlo.format_grad_reductions(hlo.collectives(compiled, mesh)))
    say(dry_run_report(facts["observer"], compiled, facts["device_kind"]))


def train_until_stopped(
    make_run: Any, restored: Any, signals: Any, closing: tuple[Any, MetricsLog]
) -> int:
    """Train the spmd.training.loop.Run that `make_run(agreed stop)` makes from the restored
    checkpoint (or the start) to the end or a stop; the exit status. `closing` (the checkpoint
    manager or None, the metrics log) are closed after the last save is written."""
    from spmd.parallel import distributed
    from spmd.training.job import AgreedStop
    from spmd.training.loop import train_loop

    manager, log = closing
    try:
        agreed = AgreedStop(signals, distributed.client(), distributed.process_id())
        loop_run = make_run(agreed)
        start = initial_state(loop_run, restored)
        if start is None:
            return 0
        sets = [loop_run.windows, *loop_run.eval_sets.values()]
        reference_cache.fill(loop_run.cfg, loop_run.program, start[0]["params"], sets, say)
        return train_loop(loop_run, *start)
    except KeyboardInterrupt:  # a second SIGINT stops at once: the save in flight is given up
        manager = None
        raise
    finally:
        if manager is not None:
            manager.close()  # waits for a save still being written
        log.close()


def resolve_sections(argv: list[str] | None) -> dict[str, Any]:
    """The config tree of the command line (and `print_config`, whether --print-config was
    given; "given", the fields the user gave); with --init-from-hf the Hugging Face folder's
    config.json is the architecture."""
    resolved = resolve.run_config(argv, "python -m spmd.train", printable=True)
    return resolve.with_optimizer_defaults(resolve.steps_from_epochs(resolved))


def compile_step(cfg: Config, program: AnyProgram) -> tuple:
    """(the compiled train step, what the config record and dry run report of it), printing the
    compile time and per-device memory."""

    from spmd.observe.observer import make_observer, model_metrics

    started = time.perf_counter()
    compiled = program.compile_train_step(cfg.run.batch, cfg.run.seq_len)
    compile_s = time.perf_counter() - started
    state_bytes = state_bytes_per_device(compiled, program)
    by_memory = offload.state_bytes_by_memory(compiled, program)
    memory = hlo.memory(compiled)
    say(
        f"compiled the train step in {compile_s:.1f} s | per device: params "
        f"{state_bytes['params'] / 2**20:.2f} MiB, optimizer state "
        f"{state_bytes['opt_state'] / 2**20:.2f} MiB, temp {memory.get('temp', 0) / 2**20:.2f} "
        f"MiB with --remat {cfg.model.remat} (activations kept for the backward pass)"
        + offload.describe(by_memory, cfg.parallel.offload)
    )

    say(f"model choices while tracing: {notes() or 'none'}")  # e.g. the attention kernel
    fingerprint = hlo.fingerprint(compiled)
    say(f"train step HLO fingerprint {fingerprint}")  # spmd.bench prints its own
    facts = {
        "hlo_fingerprint": fingerprint,
        "model_notes": notes(),
        "compile_s": compile_s,
        "state_bytes": state_bytes,
        "state_bytes_by_memory": by_memory,
        "memory": memory,
        "device_kind": jax.devices()[0].device_kind,
        "observer": make_observer(
            cfg.observe,
            cfg.run,
            cfg.precision.precision,
            cfg.model,
            program.layout.mesh,
            compiled,
            cfg.preference.dpo_precompute_reference,
        ),
    }
    step_metrics = builder.run_model(cfg).metrics  # e.g. the router's, of the adapted model
    if step_metrics is not None:
        facts["observer"].model_metrics = model_metrics(program, step_metrics)
    if cfg.parallel.dcn_sync == "diloco":
        from spmd.estimate import dcn_traffic

        assert isinstance(program, DilocoProgram) and isinstance(compiled, Compiled)
        facts["dcn_traffic"] = dcn_traffic.traffic(program, compiled)
        say(dcn_traffic.format_traffic(facts["dcn_traffic"]))
    return compiled, facts


def write_config_record(
    log: MetricsLog, cfg: Config, program: AnyProgram, facts: dict, pipe_report: Any
) -> None:
    """The first JSONL record: the resolved config, the mesh and what the compile found."""

    mesh = program.layout.mesh
    log.write(
        "config",
        config=cfg.as_dict(),
        mesh=dict(mesh.shape),
        mesh_text=format_mesh(dict(mesh.shape)),
        devices=mesh.size,
        device_kind=facts["device_kind"],
        platform=jax.devices()[0].platform,
        n_params=family.of(cfg.model).n_params(cfg.model),
        hlo_fingerprint=facts["hlo_fingerprint"],
        state_bytes_per_device=facts["state_bytes"],
        state_bytes_by_memory=facts["state_bytes_by_memory"],  # device / host, --offload
        compile_s=facts["compile_s"],
        flops_per_step=facts["observer"].flops_per_step,
        peak_tflops_per_device=facts["observer"].peak,
        memory_per_device=facts["memory"],
        batch_arithmetic=batch_arithmetic(cfg, program.layout.data_parallel),
        pipeline=pipe_report,
        dcn_traffic=facts.get("dcn_traffic"),  # --dcn-sync diloco: cross-host bytes per step
        xla_flags=facts.get("xla_flags"),
        model_notes=facts["model_notes"],
    )


def initial_state(run: Run, restored: Any) -> tuple[dict[str, Any], int] | None:
    """(state, first step) to train from: the restored checkpoint's, the Hugging Face
    weights of --init-from-hf, or a fresh init; None when the checkpoint already completes
    --steps."""
    cfg, program = run.cfg, run.program
    if restored is not None:
        run.log.write("resume", step=restored.step, checkpoint_dir=cfg.checkpoint.checkpoint_dir)
        if restored.step >= cfg.run.steps:
            say(f"the checkpoint at step {restored.step} already completes --steps {cfg.run.steps}")
            return None
        return program.from_checkpoint(restored.state)._asdict(), restored.step + 1
    from spmd.run.weights import initial  # --init-from-hf, --dpo-reference or the seed

    params, opt_state, loss_scale = initial(cfg, program)
    return {"params": params, "opt_state": opt_state, "loss_scale": loss_scale}, 1


def command() -> None:
    """`python -m spmd.train` as a process (spmd.errors.end_process: it does not wait on the
    threads a failed or interrupted save leaves)."""

    survive_a_lost_console()  # a killed launcher's closed pipe must not end the run unsaved
    end_process(main)


if __name__ == "__main__":
    command()
