"""Join a multi-process JAX job when this process is one of several.

Where the job comes from, first found first:

1. flags: `--coordinator HOST:PORT --num-processes N --process-id I`;
2. the environment spmd.launch sets (SPMD_COORDINATOR, SPMD_NUM_PROCESSES, SPMD_PROCESS_ID);
3. JAX's own cluster detection, the one `jax.distributed.initialize()` runs without arguments.
   In this JAX version (0.10) it knows, in this order: Open MPI (OMPI_MCA_orte_hnp_uri, which
   Open MPI 4's mpirun sets; Open MPI 5 does not), SLURM (SLURM_JOB_ID, SLURM_STEP_NODELIST,
   SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID, as srun sets them), Cloud TPU VMs (GCE, and
   GKE through TPU_WORKER_HOSTNAMES), and Kubernetes (KUBERNETES_SERVICE_HOST, with the
   `kubernetes` package installed: `pip install "jax[k8s]"`; the pod must belong to an Indexed
   Job, e.g. of a JobSet, and its service account may read pods and jobs). spmd asks it only
   in a Kubernetes pod that has a JOB_COMPLETION_INDEX (in any other pod JAX's Kubernetes
   bootstrap fails), and joins only when it finds more than one process: one SLURM task or
   a one-pod Job runs as a plain single process. mpi4py is JAX's opt-in method and is not
   tried.

JAX's SLURM and Open MPI detection gives each process one GPU, that of its local rank (JAX
assumes one process per GPU); a process that should drive every GPU of its node (spmd's usual
layout: one process per host) needs JAX_LOCAL_DEVICE_IDS=0,1,...,7 (examples/slurm_multinode.sh).
Kubernetes leaves every device of the pod visible. Must run before anything asks JAX for devices.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import jax

from spmd.errors import UsageError
from spmd.parallel.peer_watch import PeerWatch

# What `initialize` found, for code that must behave differently in a multi-process job.
_JOB = {"num_processes": 1, "process_id": 0}


def num_processes() -> int:
    return _JOB["num_processes"]


def process_id() -> int:
    return _JOB["process_id"]


def client() -> Any:
    """The distributed runtime's client (its key-value store reaches every process of the job)
    in a multi-process job; None in a single process. JAX keeps it in a private module, untyped
    (Any: its methods are the key-value store's)."""
    if num_processes() == 1:
        return None
    # jax's private modules are imported where used (here and below), not at the top: should
    # a jax release move them, only multi-process jobs fail, not every import of spmd
    from jax._src import distributed

    return distributed.global_state.client


def detected_cluster() -> tuple[str, int] | None:
    """(the cluster's name, its process count) when JAX's cluster detection finds a job of more
    than one process (see the module's text), else None."""
    # JAX keeps its detection private: the environments jax.distributed.initialize() tries,
    # in its order. tests/test_multihost.py checks that this still finds a SLURM job.
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        if env is clusters.K8sCluster and "JOB_COMPLETION_INDEX" not in os.environ:
            continue  # not an Indexed Job's pod: JAX's Kubernetes bootstrap cannot work
        if env.is_env_present():
            count = env.get_process_count()
            return (env.__name__.removesuffix("Cluster"), count) if count > 1 else None
    return None


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


def parse_coordinator(address: str) -> tuple[str, int]:
    """(host, port) of a --coordinator HOST:PORT; UsageError for anything else."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"--coordinator {address!r} is not HOST:PORT with a port in 1..65535, e.g. "
            f"10.0.0.1:1234"
        )
    return host, int(port)


# Seconds a process of the job may go silent before the others end naming it
# (spmd.parallel.peer_watch): --peer-timeout, else this variable, which spmd.launch sets above
# its --hang-timeout so that its own watchdog (it watches steps) acts first, else JAX's own
# heartbeat default. JAX's deadline is set JAX_DEADLINE_MARGIN_S later, so the watch speaks first.
PEER_TIMEOUT_ENV = "SPMD_PEER_TIMEOUT_S"
DEFAULT_PEER_TIMEOUT_S = 100  # jax.distributed.initialize's default heartbeat_timeout_seconds


def peer_timeout(flag: int = 0) -> int:
    """The seconds of silence after which a peer is named: `flag` if given, else spmd.launch's."""
    return flag or int(os.environ.get(PEER_TIMEOUT_ENV, DEFAULT_PEER_TIMEOUT_S))


def initialize(
    coordinator: str = "",
    num_processes: int = 0,
    process_id: int = -1,
    timeout_s: int = 180,
    peer_timeout_s: int = 0,
) -> int:
    """Start jax.distributed if this is a multi-process job (flags, spmd.launch, or a cluster
    JAX detects; see the module's text) and watch its peers; return the number of processes.
    `timeout_s`: the seconds to wait for every process to join before a line says none formed;
    `peer_timeout_s`: a peer silent that long ends this process naming it (0: `peer_timeout`)."""
    silence = peer_timeout(peer_timeout_s)
    launched = False  # spmd.launch starts every process at once: no wait worth a line
    if not coordinator:
        env = cluster_from_env()
        launched = env is not None
        if env is not None:
            coordinator = str(env["coordinator"])
            num_processes, process_id = int(env["num_processes"]), int(env["process_id"])
    if coordinator:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise UsageError(
                f"--coordinator {coordinator} needs --num-processes N >= 1 and --process-id in "
                f"[0, N); got {num_processes} and {process_id}"
            )
        parse_coordinator(coordinator)
        if num_processes == 1:
            return 1
        _without_preemption_service()
        if not launched:
            print(
                f"process {process_id}: joining a job of {num_processes} processes at "
                f"coordinator {coordinator} (waiting up to {timeout_s} s, --coordinator-timeout)",
                file=sys.stderr,
                flush=True,
            )
        _join(timeout_s, silence, coordinator, num_processes=num_processes, process_id=process_id)
        _JOB.update(num_processes=num_processes, process_id=process_id)
        PeerWatch(client(), process_id, num_processes, silence).start()
        return num_processes
    cluster = detected_cluster()
    if cluster is None:
        _refuse_an_undetected_job()
    else:
        _without_preemption_service()
        _join(timeout_s, silence)  # the same detection again: the coordinator, rank, devices
        # What it found, read where it keeps it: jax.process_count() would start the backend,
        # before spmd.parallel.mesh sets how many CPU devices to simulate.
        from jax._src import distributed

        state = distributed.global_state
        _JOB.update(num_processes=state.num_processes, process_id=state.process_id)
        if state.process_id == 0:
            print(f"joined a {cluster[0]} job of {cluster[1]} processes", file=sys.stderr)
        PeerWatch(client(), state.process_id, state.num_processes, silence).start()
        return state.num_processes
    return 1


def _join(timeout_s: int, silence_s: int, coordinator: str | None = None, **job: Any) -> None:
    """jax.distributed.initialize, given up after `timeout_s` seconds with one line and exit
    status 2. JAX itself does not raise when a peer or the coordinator never answers: its C++
    client ends the process (status 134, a stack dump) once its own deadline passes, so a
    watchdog thread ends it first, and says every WAIT_NOTE_S seconds that it still waits.
    JAX's heartbeat deadline goes after `silence_s`, the peer watch's."""
    joined = threading.Event()
    where = f"coordinator {coordinator}" if coordinator else "the detected cluster"

    def watch() -> None:
        waited = 0.0
        while not joined.wait(min(WAIT_NOTE_S, timeout_s - waited)):
            waited = min(waited + WAIT_NOTE_S, timeout_s)
            if waited >= timeout_s:
                print(
                    f"error: no job formed at {where} within --coordinator-timeout {timeout_s} "
                    f"s: process 0 or a peer did not start, or the address is wrong",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(2)
            print(f"still waiting for the job at {where} ({waited:g} s)", file=sys.stderr)

    threading.Thread(target=watch, name="spmd_join_watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(
            coordinator,
            # JAX's own deadline after the watchdog's, so that the watchdog speaks first
            initialization_timeout=timeout_s + JAX_DEADLINE_MARGIN_S,
            heartbeat_timeout_seconds=silence_s + JAX_DEADLINE_MARGIN_S,
            **job,
        )
    finally:
        joined.set()


WAIT_NOTE_S = 30  # seconds between "still waiting" lines while the job forms
JAX_DEADLINE_MARGIN_S = 30


# What launchers tell each of their processes about the job's size, whatever JAX detects.
LAUNCHER_SIZES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _refuse_an_undetected_job() -> None:
    """UsageError when a launcher started several processes but JAX's detection found no job
    (Open MPI 5, or a SLURM step without its step variables): each would train alone, all into
    one --checkpoint-dir."""
    for name in LAUNCHER_SIZES:
        size = os.environ.get(name, "")
        if size.isdigit() and int(size) > 1:
            raise UsageError(
                f"{name}={size}: this process is one of {size}, but JAX's cluster detection "
                f"found no job to join (it reads Open MPI 4's mpirun and SLURM's srun); give "
                f"--coordinator HOST:PORT --num-processes {size} --process-id RANK"
            )


def _without_preemption_service() -> None:
    """JAX's preemption service catches SIGTERM in C++, out of Python's reach, and agrees only
    on SIGTERM; spmd.training.job agrees on every stop (SIGTERM, SIGINT) itself."""
    jax.config.update("jax_enable_preemption_service", False)
