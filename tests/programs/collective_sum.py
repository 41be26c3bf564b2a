"""A minimal multi-process JAX program for the launcher tests: every process joins the job,
sums a global array across all devices of all processes, and prints the result. With
DIE_RANK set, that rank dies by SIGKILL after the sum (a crashed host)."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spmd.parallel import distributed  # noqa: E402
from spmd.parallel import mesh as mesh_lib  # noqa: E402

distributed.initialize()
mesh_lib.simulate_cpu_devices(distributed.local_devices_from_env(), announce=False)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

mesh = mesh_lib.build_mesh(mesh_lib.parse_mesh("dp=-1"))
n = mesh.size
x = jax.make_array_from_callback(
    (n,),
    NamedSharding(mesh, PartitionSpec("data")),
    lambda index: np.arange(n, dtype=np.float32)[index],
)
total = float(jax.jit(jnp.sum)(x))
print(f"process {jax.process_index()}/{jax.process_count()} devices {n} sum {total:g}", flush=True)
if os.environ.get("DIE_RANK") == str(jax.process_index()):
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(float(os.environ.get("LINGER_S", "0")))
