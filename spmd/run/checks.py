"""What a training run's flags must satisfy before any device work (each bad value is a
UsageError, exit 2, naming the value and what would be valid), and the batch self-check the
run prints: micro-batch x accum x data-parallel = global batch."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import jax

from models import family, finetune
from spmd.errors import UsageError
from spmd.estimate import long_sequence
from spmd.estimate.units import binary
from spmd.log import say
from spmd.observe import profile
from spmd.run import config, harness
from spmd.run.config import Config
from spmd.run.output_paths import check_paths  # noqa: F401 (spmd.train reads it from here)

if TYPE_CHECKING:
    from spmd.sections import RunConfig


def check_choices(cfg: Config) -> None:
    """UsageError for values outside their valid range (before any device work): the one
    check of a run's config, which asks the model family's, the data's, the optimizer's and
    the divergence section's own checks."""
    check_counts(cfg)
    harness.check_training(cfg.data)
    if not 0 <= cfg.data.eval_fraction < 1:
        raise UsageError(f"--eval-fraction {cfg.data.eval_fraction} must be in [0, 1)")
    from spmd.engine import optimizers, precision
    from spmd.engine.optim import check_hyperparameters

    check_hyperparameters(cfg.optimizer)
    optimizers.check_fields(cfg.optimizer)  # another optimizer's flag; Lion's, Muon's numbers
    if optimizers.get(cfg.optimizer.optimizer).eval_params and cfg.parallel.dcn_sync == "diloco":
        raise UsageError(
            f"--optimizer {cfg.optimizer.optimizer} evaluates averaged params, which DiLoCo's "
            f"outer step does not keep: use --dcn-sync every-step or another --optimizer"
        )
    if not cfg.run.epochs:  # else once the data says how many steps --epochs makes
        check_steps(cfg)
    precision.from_section(cfg.precision)  # UsageError naming the valid values
    family.of(cfg.model).check(cfg.model)  # the model's sizes, heads, remat, experts
    lora = cfg.lora  # rank, alpha, dropout, targets and base dtype, with LoRA off too
    fam = family.of(cfg.model)
    rank, alpha, dropout, targets = (
        lora.lora_rank,
        lora.lora_alpha,
        lora.lora_dropout,
        lora.lora_targets,
    )
    finetune.lora_spec(fam, rank, alpha, dropout, targets, lora.lora_base_dtype)
    embed = fam.shape(cfg.model).embed_dim
    if lora.lora_base_dtype and embed % finetune.NF4_BLOCK:
        raise UsageError(
            f"--lora-base-dtype {lora.lora_base_dtype} quantizes along embed in blocks of "
            f"{finetune.NF4_BLOCK}: this model's embed_dim {embed} is not a multiple of it; "
            f"leave the base unquantized"
        )
    check_checkpoint_choices(cfg)
    from spmd.io import run_data
    from spmd.training import divergence

    run_data.check_choices(cfg.data)
    divergence.check_choices(cfg.divergence, cfg.checkpoint.checkpoint_dir)
    check_observability(cfg)
    from spmd.run import samples

    samples.check(cfg)
    if cfg.data.eval_harness_every and samples.not_yet(cfg):  # it feeds the model alone too
        raise UsageError(
            f"--eval-harness-every does not evaluate under {samples.not_yet(cfg)} yet; run "
            f"spmd.eval on a checkpoint, or leave --eval-harness-every out"
        )
    check_paths(cfg)
    check_parallel(cfg)
    check_dcn_sync(cfg)


def check_steps(cfg: Config) -> None:
    """UsageError for what must fit in --steps (given, or computed from --epochs once the data
    is read): the LR schedule (--lr-scaling, --ref-batch, a WSD decay), --stop-after, the
    --profile window."""
    from spmd.engine.optim import lr_schedule

    lr_schedule(cfg.optimizer, cfg.run.steps, cfg.run.batch)
    if not 0 <= cfg.run.stop_after <= cfg.run.steps:
        raise UsageError(
            f"--stop-after {cfg.run.stop_after} must be a step in 1..--steps {cfg.run.steps} "
            f"(0: off)"
        )
    if cfg.observe.profile:
        profile.parse_window(cfg.observe.profile, cfg.run.steps)


# Counts that must be at least 1, by flag (field) name, and those that may also be 0, with
# what 0 means; a count read from a section (`seed` has its own range).
POSITIVE: tuple[str, ...] = ("steps", "batch", "accum", "seq_len", "log_every", "eval_batches")
POSITIVE += ("pp_virtual", "sync_every", "ref_batch")
ZERO_MEANS = {
    "eval_every": "only at the end",
    "microbatches": "2 x pp",
    "devices": "what the mesh needs",
    "num_processes": "from spmd.launch, SLURM or Open MPI",
}
SEED_LIMIT = 2**63  # numpy's and JAX's seeds are unsigned 64-bit at most; negatives fail


def check_counts(cfg: Config) -> None:
    """UsageError for a count below its range (--steps 0, --eval-every -1, --seed -1, ...)."""
    values = config.flat_values(cfg.as_dict())
    if values["epochs"] < 0:
        raise UsageError(f"--epochs {values['epochs']} must be a positive integer, or 0 (--steps)")
    for name in POSITIVE:
        if name == "steps" and values["epochs"]:  # computed from the data
            continue
        if values[name] < 1:
            raise UsageError(f"{config.flag_name(name)} {values[name]} must be a positive integer")
    for name, zero in ZERO_MEANS.items():
        if values[name] < 0:
            raise UsageError(f"{config.flag_name(name)} {values[name]} must be >= 0 (0: {zero})")
    if not 0 <= cfg.run.seed < SEED_LIMIT:
        raise UsageError(f"--seed {cfg.run.seed} must be an integer in [0, 2**63)")
    processes, rank = cfg.run.num_processes, cfg.run.process_id
    if rank < -1 or (processes and rank >= processes):
        valid = f"in [0, {processes})" if processes else ">= 0"
        raise UsageError(f"--process-id {rank} must be {valid}, or -1 (detect)")
    check_job_flags(cfg.run)


def check_job_flags(run: RunConfig) -> None:
    """UsageError unless --coordinator, --num-processes and --process-id describe a job
    together: all three (a HOST:PORT, a count, a rank in it) or none of them (spmd.launch or a
    cluster JAX detects says the rest), a --coordinator-timeout of at least one second and a
    --peer-timeout of at least one (or 0: the default)."""
    from spmd.parallel import distributed

    if run.coordinator_timeout < 1:
        raise UsageError(
            f"--coordinator-timeout {run.coordinator_timeout} must be at least 1 second"
        )
    if run.peer_timeout < 0:
        raise UsageError(
            f"--peer-timeout {run.peer_timeout} must be at least 1 second, or 0 (spmd.launch's "
            f"--hang-timeout + 60, else 100)"
        )
    given = {"--num-processes": run.num_processes > 0, "--process-id": run.process_id >= 0}
    if not run.coordinator:
        named = [flag for flag, on in given.items() if on]
        if named:
            raise UsageError(
                f"{' and '.join(named)} without --coordinator HOST:PORT would train alone; give "
                f"all three of --coordinator, --num-processes and --process-id, or none "
                f"(spmd.launch and the clusters JAX detects set them)"
            )
        return
    distributed.parse_coordinator(run.coordinator)
    if not all(given.values()):
        raise UsageError(
            f"--coordinator {run.coordinator} needs --num-processes N and --process-id in "
            f"[0, N) too"
        )


def check_parallel(cfg: Config) -> None:
    """UsageError for the parallel section's strings and sizes, whether or not this run uses
    them (a bad value is never silently ignored): --zero, --mesh and --dcn-mesh, the executor,
    the pipeline schedule, --bucket-mb."""
    from spmd.engine.step import check_executor
    from spmd.parallel import rules, schedules
    from spmd.parallel.mesh import check_devices, check_stage_zero, parse_mesh

    p = cfg.parallel
    if p.zero not in rules.ZERO_STAGES:
        raise UsageError(f"--zero {p.zero} is not a ZeRO stage; use {rules.ZERO_CHOICES}")
    sizes = parse_mesh(p.mesh)
    check_stage_zero(p.zero, sizes)
    check_devices(p.mesh, p.devices, processes_of(cfg))
    if cfg.precision.fp8_all_gather and (p.zero != 3 or sizes.get("fsdp", 1) == 1):
        raise UsageError(
            f"--fp8-all-gather gathers ZeRO-3's params; this run has --zero {p.zero} and mesh "
            f"{p.mesh!r} (use --zero 3 with fsdp >= 2, or leave --fp8-all-gather off)"
        )
    if p.dcn_mesh:
        check_dcn_mesh(p.mesh, p.dcn_mesh, processes_of(cfg))
    check_executor(p.collectives)
    if p.pp_schedule not in schedules.SCHEDULES:
        raise UsageError(
            f"--pp-schedule {p.pp_schedule!r} is not one of {', '.join(schedules.SCHEDULES)}"
        )
    if not 0 <= p.bucket_mb < math.inf:
        raise UsageError(f"--bucket-mb {p.bucket_mb} must be 0 (no buckets) or a size in MiB")


def processes_of(cfg: Config) -> int:
    """The job's process count as far as it is known before joining it: --num-processes, else
    what spmd.launch says, else 0 (unknown)."""

    launched = os.environ.get("SPMD_NUM_PROCESSES", "")
    return cfg.run.num_processes or (int(launched) if launched.isdigit() else 0)


def check_dcn_mesh(mesh: str, dcn_mesh: str, processes: int) -> None:
    """UsageError for a --dcn-mesh that --mesh cannot hold: an axis -1, an axis whose host ways
    do not divide that axis of --mesh, or (the job's size known) ways whose product is not
    the process count."""
    from spmd.parallel.mesh import MESH_AXES, parse_mesh

    dcn, sizes = parse_mesh(dcn_mesh, "--dcn-mesh"), parse_mesh(mesh)
    if -1 in dcn.values():
        raise UsageError(f"--dcn-mesh {dcn_mesh}: give each axis's host count; -1 is for --mesh")
    for axis in MESH_AXES:
        if dcn[axis] > 1 and sizes[axis] != -1 and sizes[axis] % dcn[axis]:
            raise UsageError(
                f"--dcn-mesh {dcn_mesh}: {dcn[axis]} host ways of {axis!r} do not divide its "
                f"size {sizes[axis]} in --mesh {mesh}; give ways that divide each axis"
            )
    hosts = math.prod(dcn.values())
    if processes and hosts != processes:
        raise UsageError(
            f"--dcn-mesh {dcn_mesh} spans {hosts} processes but the job has {processes}; make "
            f"the product of its ways {processes}"
        )


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
    from spmd.io import checkpoint

    if cfg.checkpoint.checkpoint_every < 0:
        raise UsageError(
            f"--checkpoint-every {cfg.checkpoint.checkpoint_every} must be a step count, or 0 "
            f"(at the end)"
        )
    keep = cfg.checkpoint.keep_checkpoints
    if keep < checkpoint.MIN_KEEP:  # the newest is judged by the next step's loss: keep another
        raise UsageError(
            f"--keep-checkpoints {keep} must be at least {checkpoint.MIN_KEEP}: a diverging step "
            f"rolls back past the newest checkpoint to the one before it"
        )
    if cfg.run.stop_after < 0:
        raise UsageError(f"--stop-after {cfg.run.stop_after} must be a step, or 0 (off)")
    resume = cfg.checkpoint.resume  # one of its choices: config.build refuses the others
    needing_a_folder = (
        ("--resume required", resume == "required"),
        ("--stop-after", cfg.run.stop_after),
    )
    for flag, given in needing_a_folder:
        if given and not cfg.checkpoint.checkpoint_dir:
            raise UsageError(f"{flag} needs --checkpoint-dir, the folder of the run's checkpoints")


def check_observability(cfg: Config) -> None:
    """UsageError for bad --profile, --peak-tflops, --comm-warn, --straggler-threshold."""
    from spmd.observe import trackers
    from spmd.training import run_folder

    if "" in (item.strip() for item in cfg.observe.tracker.split(",")):
        raise UsageError(
            f"--tracker {cfg.observe.tracker!r} has an empty item; separate names by one comma"
        )
    trackers.check_names(run_folder.trackers(cfg))
    check_run_name(cfg.run.run_name)
    # Written as `not (x >= 0)` so that NaN, which fails every comparison, is refused too.
    if not (0 <= cfg.observe.peak_tflops < math.inf):
        raise UsageError(
            f"--peak-tflops {cfg.observe.peak_tflops} must be 0 (the table) or positive"
        )
    if not 0 < cfg.observe.comm_warn <= 1:
        raise UsageError(f"--comm-warn {cfg.observe.comm_warn} must be a fraction in (0, 1]")
    if not (0 <= cfg.observe.straggler_threshold < math.inf):
        raise UsageError(f"--straggler-threshold {cfg.observe.straggler_threshold} must be >= 0")


def check_run_name(name: str) -> None:
    """UsageError for a --run-name that is not one folder name inside the runs folder."""
    if name and (name in (".", "..") or any(c in name for c in "/\\\0")):
        raise UsageError(
            f"--run-name {name!r} must be one folder name (no '/', '\\', '.' or '..'); give "
            f"--run-dir to put the run folder elsewhere"
        )


def checkpoint_resumes(cfg: Config) -> bool:
    """Whether the run continues from its --checkpoint-dir (under --resume auto: when the folder
    holds a complete checkpoint). UsageError for a folder that --resume required cannot continue
    (none, or a params-only conversion) or that --resume fresh would overwrite."""
    from spmd.io import checkpoint
    from spmd.io.params_io import refuse_resume

    directory, resume = cfg.checkpoint.checkpoint_dir, cfg.checkpoint.resume
    resumes = checkpoint.check_directory(directory, resume, cfg.checkpoint.allow_unverified)
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


def step_memory_error(cfg: Config, facts: dict[str, Any], mesh: Any) -> str | None:
    """The sentence saying why the compiled train step cannot fit a device (its per-device
    bytes, XLA's peak estimate: arguments + outputs + temp - aliased, above what one of the
    mesh's devices holds, spmd.observe.capacity), naming the flags that shrink it; None when
    it fits or the device's memory is unknown. Checked after compiling, before allocating."""

    from spmd.observe.capacity import device_capacity

    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    capacity = device_capacity(local)
    from spmd.engine import offload

    memory, placed = facts["memory"], facts["state_bytes_by_memory"]
    # what the device holds: the state in host memory (--offload) is not counted
    parts = {"params": placed["params"]["device"], "optimizer state": placed["opt_state"]["device"]}
    parts["temp"] = memory.get("temp", 0)
    need = offload.device_peak(memory, offload.totals(placed)["host"]) or sum(parts.values())
    if capacity is None or need <= capacity.bytes:
        return None
    shrink = ["--remat full"] if cfg.model.remat != "full" else []
    shrink.append("--zero 3 over a larger fsdp axis" if cfg.parallel.zero < 3 else "")
    shrink += ["a larger mesh", f"more --accum (now {cfg.run.accum})"]
    shrink += [f"a smaller --batch (now {cfg.run.batch})"]
    shrink += [f"a shorter --seq-len (now {cfg.run.seq_len})"]
    if cfg.parallel.offload != "params":
        shrink += [
            "--offload optimizer" if cfg.parallel.offload == "none" else "--offload params --zero 3"
        ]
    return (
        f"the compiled train step needs {binary(need)} per device ("
        + ", ".join(f"{k} {binary(v)}" for k, v in parts.items())
        + f") but a device holds {binary(capacity.bytes)} ({capacity.source}); shrink it "
        f"with {', '.join(s for s in shrink if s)}"
    )


def check_sequence_split(
    seq_len: int,
    sizes: dict[str, int],
    sequence_parallel: bool,
    moe: bool = False,
) -> None:
    """UsageError when the mesh cannot split --seq-len: context parallelism cuts it in
    2·cp chunks; --sequence-parallel needs tp > 1 and each device's length a multiple of tp,
    and does not compose with an MoE model yet (context parallelism does where the model
    drops no token: models.moe.check_layout)."""
    context, tensor = sizes.get("context", 1), sizes.get("tensor", 1)
    if moe and sequence_parallel:
        raise UsageError(
            "an MoE model (--n-experts) does not compose with --sequence-parallel yet: its "
            "router and expert dispatch see whole rows of tokens; leave --sequence-parallel off"
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
