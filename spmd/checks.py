"""What a training run's flags must satisfy before any device work (each bad value is a
UsageError, exit 2, naming the value and what would be valid), and the batch self-check the
run prints: micro-batch x accum x data-parallel = global batch."""

from __future__ import annotations

import math
from typing import Any

from models import llama
from spmd import config
from spmd.config import Config
from spmd.errors import UsageError
from spmd.estimate import long_sequence
from spmd.log import say
from spmd.observe import profile
from spmd.sections import RESUME_MODES


def check_choices(cfg: Config) -> None:
    """UsageError for values outside their valid range (before any device work): the one
    check of a run's config, which asks the data and divergence sections' own checks."""
    positive = {
        "steps": cfg.run.steps,
        "batch": cfg.run.batch,
        "seq_len": cfg.run.seq_len,
        "log_every": cfg.observe.log_every,
        "eval_batches": cfg.data.eval_batches,
    }
    for name, value in positive.items():
        if value < 1:
            raise UsageError(f"{config.flag_name(name)} {value} must be a positive integer")
    if cfg.parallel.devices < 0:
        raise UsageError(
            f"--devices {cfg.parallel.devices} must be 0 (as needed) or a device count"
        )
    if not 0 <= cfg.data.eval_fraction < 1:
        raise UsageError(f"--eval-fraction {cfg.data.eval_fraction} must be in [0, 1)")
    from spmd.engine import precision
    from spmd.engine.optim import check_hyperparameters, lr_schedule

    check_hyperparameters(cfg.optimizer)
    # UsageError for --lr-scaling, --ref-batch, --lr-schedule and a WSD decay that cannot fit
    lr_schedule(cfg.optimizer, cfg.run.steps, cfg.run.batch)
    precision.get(
        cfg.precision.precision, cfg.precision.grad_reduce
    )  # UsageError naming the valid values
    model = cfg.model
    if model.remat not in llama.REMAT_POLICIES:
        raise UsageError(f"--remat {model.remat!r} is not one of {', '.join(llama.REMAT_POLICIES)}")
    if model.n_heads % model.n_kv_heads:
        raise UsageError(f"--n-kv-heads {model.n_kv_heads} must divide --n-heads {model.n_heads}")
    check_checkpoint_choices(cfg)
    from spmd.io import run_data
    from spmd.training import divergence

    run_data.check_choices(cfg.data)
    divergence.check_choices(cfg.divergence, cfg.checkpoint.checkpoint_dir)
    check_observability(cfg)
    from spmd.engine.step import check_executor

    check_executor(cfg.parallel.collectives)
    check_dcn_sync(cfg)


def check_dcn_sync(cfg: Config) -> None:
    """UsageError for a --dcn-sync mode that does not exist or DiLoCo flags without it (the
    numbers themselves are checked by spmd.engine.diloco.check)."""
    from spmd.engine.diloco import MODES

    if cfg.parallel.dcn_sync not in MODES:
        raise UsageError(f"--dcn-sync {cfg.parallel.dcn_sync!r} is not one of {', '.join(MODES)}")
    if cfg.parallel.dcn_sync != "diloco" and cfg.parallel.diloco_axis:
        raise UsageError(
            f"--diloco-axis {cfg.parallel.diloco_axis} needs --dcn-sync diloco (replicas that sync "
            f"every --sync-every steps)"
        )


def check_dcn_sync_mesh(cfg: Config, mesh: Any, n_processes: int) -> None:
    """Under --dcn-sync diloco: UsageError unless the data axis is what holds the replicas (on
    one process by --diloco-axis data; across processes, all of it crossing hosts)."""
    if cfg.parallel.dcn_sync != "diloco":
        return
    from spmd.engine import diloco
    from spmd.parallel.mesh import dcn_split

    sizes = dict(mesh.shape)
    if sizes.get("context", 1) > 1:  # the ring's shard_map cannot sit inside DiLoCo's vmap
        raise UsageError(f"--dcn-sync diloco does not compose with cp={sizes['context']} yet")
    dcn = dcn_split(sizes, n_processes, cfg.parallel.dcn_mesh) if n_processes > 1 else None
    diloco.check_mesh(cfg.parallel.diloco_axis, n_processes, dcn, sizes)


def check_checkpoint_choices(cfg: Config) -> None:
    """UsageError for checkpoint flags that cannot work together."""
    if cfg.checkpoint.checkpoint_every < 0:
        raise UsageError(
            f"--checkpoint-every {cfg.checkpoint.checkpoint_every} must be a step count, or 0 "
            f"(at the end)"
        )
    if cfg.checkpoint.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints {cfg.checkpoint.keep_checkpoints} must be at least 1")
    if not 0 <= cfg.run.stop_after <= cfg.run.steps:
        raise UsageError(
            f"--stop-after {cfg.run.stop_after} must be a step in 1..--steps {cfg.run.steps} "
            f"(0: off)"
        )
    resume = cfg.checkpoint.resume
    if resume not in RESUME_MODES:
        raise UsageError(f"--resume {resume!r} is not one of {', '.join(RESUME_MODES)}")
    needing_a_folder = (
        ("--resume required", resume == "required"),
        ("--stop-after", cfg.run.stop_after),
    )
    for flag, given in needing_a_folder:
        if given and not cfg.checkpoint.checkpoint_dir:
            raise UsageError(f"{flag} needs --checkpoint-dir, the folder of the run's checkpoints")


def check_observability(cfg: Config) -> None:
    """UsageError for bad --profile, --peak-tflops, --comm-warn, --straggler-threshold."""
    if cfg.observe.profile:
        profile.parse_window(cfg.observe.profile, cfg.run.steps)
    # Written as `not (x >= 0)` so that NaN, which fails every comparison, is refused too.
    if not (0 <= cfg.observe.peak_tflops < math.inf):
        raise UsageError(
            f"--peak-tflops {cfg.observe.peak_tflops} must be 0 (the table) or positive"
        )
    if not 0 < cfg.observe.comm_warn <= 1:
        raise UsageError(f"--comm-warn {cfg.observe.comm_warn} must be a fraction in (0, 1]")
    if not (0 <= cfg.observe.straggler_threshold < math.inf):
        raise UsageError(f"--straggler-threshold {cfg.observe.straggler_threshold} must be >= 0")


def checkpoint_resumes(cfg: Config) -> bool:
    """Whether the run continues from its --checkpoint-dir (under --resume auto: when the folder
    holds a complete checkpoint). UsageError for a folder that --resume required cannot continue
    (none, or a params-only conversion) or that --resume fresh would overwrite."""
    from spmd.io import checkpoint
    from spmd.io.params_io import refuse_resume

    directory, resume = cfg.checkpoint.checkpoint_dir, cfg.checkpoint.resume
    resumes = checkpoint.check_directory(directory, resume)
    if resumes:
        refuse_resume(directory)
        return True
    partial = checkpoint.interrupted_saves(directory)
    if resume == "auto" and partial:
        say(
            f"--checkpoint-dir {directory} holds only interrupted saves ({', '.join(partial)}), "
            f"no complete checkpoint: starting fresh"
        )
    return False


def check_sequence_split(
    seq_len: int,
    sizes: dict[str, int],
    sequence_parallel: bool,
    moe: bool = False,
    document_mask: bool = False,
) -> None:
    """UsageError when the mesh cannot split --seq-len: context parallelism cuts it in
    2·cp chunks; --sequence-parallel needs tp > 1 and each device's length a multiple of tp.
    Neither composes with an MoE model yet, and the ring does not mask documents."""
    context, tensor = sizes.get("context", 1), sizes.get("tensor", 1)
    if moe and (context > 1 or sequence_parallel):
        raise UsageError(
            "an MoE model (--n-experts) does not compose with cp > 1 or --sequence-parallel "
            "yet: its router and expert dispatch see whole sequences; use cp=1 without SP"
        )
    if context > 1 and document_mask:
        raise UsageError(
            f"cp={context} with --document-mask: ring attention does not mask documents yet; "
            f"use --document-mask off or cp=1"
        )
    split = long_sequence.split_error(seq_len, context, tensor, sequence_parallel)
    if split:
        raise UsageError(split)


def batch_arithmetic(cfg: Config, data_parallel: int) -> dict[str, Any]:
    """The textbook self-check of a run: per-device micro-batch x accum x data-parallel size =
    global batch (sequences), tokens per optimizer step, and the LR before and after scaling."""
    from spmd.engine.optim import peak_lr

    return {
        "micro_batch_per_device": cfg.run.batch // (data_parallel * cfg.run.accum),
        "accum": cfg.run.accum,
        "data_parallel": data_parallel,
        "global_batch": cfg.run.batch,
        "tokens_per_step": cfg.run.batch * cfg.run.seq_len,
        "lr": cfg.optimizer.lr,
        "lr_scaling": cfg.optimizer.lr_scaling,
        "ref_batch": cfg.optimizer.ref_batch,
        "peak_lr": peak_lr(cfg.optimizer, cfg.run.batch),
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
