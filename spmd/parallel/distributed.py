"""Join a multi-process JAX job when this process is one of several.

From flags (`--coordinator HOST:PORT --num-processes N --process-id I`), from the environment
spmd.launch sets (SPMD_COORDINATOR, SPMD_NUM_PROCESSES, SPMD_PROCESS_ID), or from JAX's own
cluster detection (SLURM, Open MPI, Kubernetes) when `auto_detect` is set; a single process
otherwise. Must run before anything asks JAX for devices.
"""

from __future__ import annotations

import os

import jax

from spmd.errors import UsageError

# What `initialize` found, for code that must behave differently in a multi-process job.
_JOB = {"num_processes": 1, "process_id": 0}


def num_processes() -> int:
    return _JOB["num_processes"]


def process_id() -> int:
    return _JOB["process_id"]


def client() -> object | None:
    """The distributed runtime's client (its key-value store reaches every process of the job)
    in a multi-process job; None in a single process. JAX keeps it in a private module."""
    if num_processes() == 1:
        return None
    from jax._src import distributed

    return distributed.global_state.client


def cluster_detected() -> bool:
    """True under a multi-task SLURM or Open MPI launch, where JAX finds its peers itself."""
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(os.environ.get(name, "1") or 1) > 1:
            return True
    return False


def cluster_from_env() -> dict[str, str | int] | None:
    """The job spmd.launch described in the environment, or None."""
    if "SPMD_COORDINATOR" not in os.environ:
        return None
    return {
        "coordinator": os.environ["SPMD_COORDINATOR"],
        "num_processes": int(os.environ["SPMD_NUM_PROCESSES"]),
        "process_id": int(os.environ["SPMD_PROCESS_ID"]),
    }


def local_devices_from_env() -> int:
    """Simulated CPU devices per process that spmd.launch asked for (0: none said)."""
    return int(os.environ.get("SPMD_LOCAL_DEVICES", "0"))


def initialize(
    coordinator: str = "", num_processes: int = 0, process_id: int = -1, auto_detect: bool = False
) -> int:
    """Start jax.distributed if this is a multi-process job; return the number of processes."""
    if not coordinator:
        env = cluster_from_env()
        if env is not None:
            coordinator = str(env["coordinator"])
            num_processes, process_id = int(env["num_processes"]), int(env["process_id"])
    if coordinator:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise UsageError(
                f"--coordinator {coordinator} needs --num-processes N >= 1 and --process-id in "
                f"[0, N); got {num_processes} and {process_id}"
            )
        if num_processes == 1:
            return 1
        _without_preemption_service()
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
        _JOB.update(num_processes=num_processes, process_id=process_id)
        return num_processes
    if auto_detect:
        _without_preemption_service()
        jax.distributed.initialize()  # SLURM / Open MPI / Kubernetes, as JAX detects them
        _JOB.update(num_processes=jax.process_count(), process_id=jax.process_index())
        return jax.process_count()
    return 1


def _without_preemption_service() -> None:
    """JAX's preemption service catches SIGTERM in C++, out of Python's reach, and agrees only
    on SIGTERM; spmd.training.job agrees on every stop (SIGTERM, SIGINT) itself."""
    jax.config.update("jax_enable_preemption_service", False)
