"""`python -m spmd.train`: train the Llama model on any mesh, printing and logging progress.

    python -m spmd.train [--config configs/X.toml] [--model tiny] [--mesh dp=2,tp=4] [...]

The resolved config is printed first; `--dry-run` compiles the step and reports per-device
memory and the compiled collectives without training. User mistakes exit with status 2 and one
line naming the bad value.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

from models import llama
from spmd import config, data, profile, tokens
from spmd.config import TrainConfig
from spmd.errors import UsageError
from spmd.loop import train_loop
from spmd.metrics import MetricsLog, say
from spmd.resume import open_checkpoints

SECTIONS = {"model": llama.LlamaConfig, "train": TrainConfig}


def expand_layout(values: dict[str, Any]) -> dict[str, Any]:
    """A named --layout fills --mesh and --zero where they were not given."""
    if not values.get("layout"):
        return values
    import meshes

    preset = meshes.get(values["layout"])
    return {"mesh": preset.mesh, "zero": preset.zero, **values}


def check_choices(train: TrainConfig, model: llama.LlamaConfig) -> None:
    """UsageError for values outside their valid range (before any device work)."""
    positive = {
        "steps": train.steps,
        "batch": train.batch,
        "seq_len": train.seq_len,
        "log_every": train.log_every,
        "eval_batches": train.eval_batches,
    }
    for name, value in positive.items():
        if value < 1:
            raise UsageError(f"{config.flag_name(name)} {value} must be a positive integer")
    if train.devices < 0:
        raise UsageError(f"--devices {train.devices} must be 0 (as needed) or a device count")
    if not 0 <= train.eval_fraction < 1:
        raise UsageError(f"--eval-fraction {train.eval_fraction} must be in [0, 1)")
    from spmd import precision

    precision.get(train.precision)  # UsageError naming the valid policies
    if model.remat not in llama.REMAT_POLICIES:
        raise UsageError(f"--remat {model.remat!r} is not one of {', '.join(llama.REMAT_POLICIES)}")
    if model.n_heads % model.n_kv_heads:
        raise UsageError(f"--n-kv-heads {model.n_kv_heads} must divide --n-heads {model.n_heads}")
    check_checkpoint_choices(train)
    check_observability(train)
    from spmd.step import check_executor

    check_executor(train.collectives)


def start_processes(train: TrainConfig) -> int:
    """Join the multi-process job if this is one (flags, spmd.launch, SLURM, Open MPI);
    only process 0 prints progress and writes metrics. Returns the number of processes."""
    from spmd import distributed
    from spmd.metrics import set_primary

    n_processes = distributed.initialize(
        train.coordinator,
        train.num_processes,
        train.process_id,
        auto_detect=distributed.cluster_detected(),
    )
    set_primary(distributed.process_id() == 0)
    return n_processes


def check_checkpoint_choices(train: TrainConfig) -> None:
    """UsageError for checkpoint flags that cannot work together."""
    if train.checkpoint_every < 0:
        raise UsageError(
            f"--checkpoint-every {train.checkpoint_every} must be a step count, or 0 (at the end)"
        )
    if train.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints {train.keep_checkpoints} must be at least 1")
    if not 0 <= train.stop_after <= train.steps:
        raise UsageError(
            f"--stop-after {train.stop_after} must be a step in 1..--steps {train.steps} (0: off)"
        )
    for flag, given in (("--resume", train.resume), ("--stop-after", train.stop_after)):
        if given and not train.checkpoint_dir:
            raise UsageError(f"{flag} needs --checkpoint-dir, the folder of the run's checkpoints")


def check_observability(train: TrainConfig) -> None:
    """UsageError for bad --profile, --peak-tflops, --comm-warn, --straggler-threshold."""
    if train.profile:
        profile.parse_window(train.profile, train.steps)
    if train.peak_tflops < 0:
        raise UsageError(f"--peak-tflops {train.peak_tflops} must be 0 (the table) or positive")
    if not 0 < train.comm_warn <= 1:
        raise UsageError(f"--comm-warn {train.comm_warn} must be a fraction in (0, 1]")
    if train.straggler_threshold < 0:
        raise UsageError(f"--straggler-threshold {train.straggler_threshold} must be >= 0")


def setup_mesh(train: TrainConfig, n_processes: int = 1):
    """Simulate CPU devices if needed (before JAX starts), then build the global mesh; in a
    multi-process job, a hybrid mesh whose `--dcn-mesh` ways cross processes."""
    from spmd import distributed
    from spmd import mesh as mesh_lib

    sizes = mesh_lib.parse_mesh(train.mesh)
    needed = mesh_lib.devices_needed(sizes)
    if needed and needed % n_processes:
        raise UsageError(
            f"--mesh {train.mesh} needs {needed} devices, which {n_processes} processes cannot "
            f"share evenly; use a mesh whose product is a multiple of {n_processes}"
        )
    local = train.devices or distributed.local_devices_from_env()
    if local:
        if not mesh_lib.cpu_only():
            raise UsageError(
                f"--devices {local} simulates CPU devices, but this machine has "
                f"accelerators; drop --devices to use them"
            )
        mesh_lib.simulate_cpu_devices(local, announce=False)
    elif needed and needed > n_processes and mesh_lib.cpu_only():
        mesh_lib.simulate_cpu_devices(needed // n_processes, announce=n_processes == 1)
    if n_processes == 1:
        return mesh_lib.build_mesh(sizes)
    import jax

    sizes = mesh_lib.resolve_mesh(sizes, len(jax.devices()))
    dcn = mesh_lib.dcn_split(sizes, n_processes, train.dcn_mesh, len(jax.local_devices()))
    return mesh_lib.build_mesh(sizes, dcn=dcn)


def pipeline_of(train: TrainConfig, model: llama.LlamaConfig, layout: Any) -> tuple:
    """(spmd.pipeline.Pipeline, its schedule report) when the mesh has pp > 1, else (None,
    None); prints the schedule's bubble and idle share. UsageError for a schedule that cannot
    run (layers, micro-batches or batch that do not split)."""
    stages = layout.mesh.shape["pipeline"]
    if stages == 1:
        return None, None
    from spmd import pipeline

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
    from spmd import distributed

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
    sections = config.resolve(argv, SECTIONS, "python -m spmd.train", expand_train=expand_layout)
    if sections["train"].init_from_hf:  # the folder's config.json is the architecture
        from models import hf_llama

        folder = hf_llama.open_checkpoint(sections["train"].init_from_hf, sections["model"].remat)
        sections["model"] = folder.config
    train, model_cfg = sections["train"], sections["model"]
    check_choices(train, model_cfg)
    n_processes = start_processes(train)
    say(config.format_config(sections))
    checkpointing = bool(train.checkpoint_dir) and not train.dry_run
    if checkpointing:
        from spmd import checkpoint

        checkpoint.check_directory(train.checkpoint_dir, train.resume)
        if train.resume:
            from spmd.params_io import refuse_resume

            refuse_resume(train.checkpoint_dir)
    token_file = tokens.open_tokens(train.data, train.tokenizer, train.data_cache)
    tokens.check_vocab(token_file, model_cfg.vocab_size)
    windows = data.TokenWindows(token_file.load(), train.seq_len, train.eval_fraction)
    say(
        f"data: {token_file.source}, {token_file.n_tokens / 1e6:.2f} M tokens "
        f"({token_file.path}), {windows.n_train} train / {windows.n_eval} eval windows of "
        f"{train.seq_len + 1}"
    )
    mesh = setup_mesh(train, n_processes)

    import jax

    from spmd import api, hlo, precision, theory
    from spmd.mesh import format_mesh
    from spmd.observe import dry_run_report, make_observer
    from spmd.optim import make_optimizer
    from spmd.step import Layout, check_batch, state_bytes_per_device

    layout = Layout(mesh, train.zero)
    check_batch(train.batch, layout, train.accum)
    mesh_text = format_mesh(dict(mesh.shape))
    device_kind = jax.devices()[0].device_kind
    policy = precision.get(train.precision)
    batch_check = batch_arithmetic(train, layout.data_parallel)
    say(
        f"mesh {mesh_text} ({mesh.size} x {device_kind}), zero {train.zero} | "
        f"{model_cfg.n_params() / 1e6:.2f} M params | {format_batch_arithmetic(batch_check)}"
    )
    say(precision.describe(policy))
    pipe, pipe_report = pipeline_of(train, model_cfg, layout)
    program = api.build(
        lambda seed: llama.create(model_cfg, seed, policy.compute_dtype),
        llama.lm_loss,
        lambda names: make_optimizer(train, names),
        mesh,
        zero_stage=train.zero,
        executor=train.collectives,
        precision_policy=train.precision,
        accum=train.accum,
        seed=train.seed,
        pipeline=pipe,
    )
    manager, restored = None, None
    if checkpointing:
        manager, restored = open_checkpoints(train, program, sections, token_file.fingerprint)
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
    observer = make_observer(train, model_cfg, mesh, compiled)
    if train.dry_run:
        shape = theory.shape_of(model_cfg, policy.compute_dtype)
        say(theory.report(program, compiled, shape, train.batch, train.seq_len, pipe_report))
        say(dry_run_report(observer, compiled, device_kind))
        return 0

    log = MetricsLog(train.metrics, append=restored is not None, tensorboard=train.tensorboard)
    log.write(
        "config",
        config=config.as_dict(sections),
        mesh=dict(mesh.shape),
        mesh_text=mesh_text,
        devices=mesh.size,
        device_kind=device_kind,
        platform=jax.devices()[0].platform,
        n_params=model_cfg.n_params(),
        state_bytes_per_device=state_bytes,
        compile_s=compile_s,
        flops_per_step=observer.flops_per_step,
        peak_tflops_per_device=observer.peak,
        memory_per_device=memory,
        batch_arithmetic=batch_check,
        pipeline=pipe_report,
    )
    from spmd.preemption import StopSignals

    # Open until the last save is written: a stop signal during the final eval or save is noted
    # (and the run ends as planned) instead of killing the process mid-save.
    with StopSignals() as stop:
        try:
            train_loop(
                train,
                sections,
                program,
                compiled,
                log,
                windows,
                token_file,
                manager,
                restored,
                stop,
                observer,
            )
        finally:
            if manager is not None:
                manager.close()  # waits for a save still being written
            log.close()
    return 0


def batch_arithmetic(train: TrainConfig, data_parallel: int) -> dict[str, Any]:
    """The textbook self-check of a run: per-device micro-batch x accum x data-parallel size =
    global batch (sequences), tokens per optimizer step, and the LR before and after scaling."""
    from spmd.optim import peak_lr

    return {
        "micro_batch_per_device": train.batch // (data_parallel * train.accum),
        "accum": train.accum,
        "data_parallel": data_parallel,
        "global_batch": train.batch,
        "tokens_per_step": train.batch * train.seq_len,
        "lr": train.lr,
        "lr_scaling": train.lr_scaling,
        "ref_batch": train.ref_batch,
        "peak_lr": peak_lr(train),
    }


def format_batch_arithmetic(check: dict[str, Any]) -> str:
    rule = (
        f"x {check['global_batch']}/{check['ref_batch']} (linear scaling)"
        if check["lr_scaling"] == "linear"
        else "(no scaling)"
    )
    return (
        f"per-device micro-batch {check['micro_batch_per_device']} x accum {check['accum']} x "
        f"data-parallel {check['data_parallel']} = global batch {check['global_batch']} "
        f"sequences ({check['tokens_per_step']:,} tokens/step) | base lr {check['lr']:g} "
        f"{rule} -> {check['peak_lr']:g}"
    )


if __name__ == "__main__":
    sys.exit(main())
