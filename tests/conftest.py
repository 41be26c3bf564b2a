"""Tests run on 8 simulated CPU devices; this must happen before JAX starts its backend.

XLA:CPU compiles without LLVM's optimizations and with its older emitters here: the tests'
programs are tiny and run a few steps each, so compiling is most of their time, and this
halves it. The optimized HLO (collectives, buffer assignment, memory figures) is the same;
only the generated machine code is slower. Each program is also emitted as one LLVM module
instead of split for parallel compiling: the suite's two workers already keep both cores busy,
and one module compiled as fast and ran the tiny model's 20 steps in 1.1-1.5 s against
1.5-1.7 s split (the suite: 484 s against 551 s, 2026-11-25). Subprocesses the tests start
inherit it."""

import atexit
import gc
import os
import shutil
import tempfile

from spmd.parallel import huge_pages  # the standard library only: JAX has not started

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, shared by the subprocesses the tests start
# (they inherit the environment): many tests compile the same step (the tiny preset on a few
# meshes, in-process and as commands), and a cached executable loads in a fraction of a second
# instead of seconds. A fresh folder per session: nothing carries over between runs.
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd-test-jax-cache-")
atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Tokenized corpora (spmd.io.tokens), W&B's and matplotlib's caches: one folder per pytest
# process (each xdist worker, shared with the processes it starts), never the user's ~/.cache
# (the examples wrote the stdlib corpus's tokens there).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="spmd-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
# A run without --run-dir writes a run folder under $SPMD_RUNS_DIR (runs/ in the working
# directory without it), checkpoint included. "none": the tests' runs write only what their
# flags name, as before run folders, and never into the repo; a run folder's final checkpoint
# would cost seconds per run (39 s on the 64-device test). tests/test_run_folder.py and
# tests/test_trackers.py set it to folders of their own.
os.environ["SPMD_RUNS_DIR"] = "none"
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# spmd's commands on a CPU restart themselves once with glibc's huge-page tunable
# (spmd.parallel.huge_pages); the subprocesses the tests start get it from the start instead,
# which saves a second interpreter start each. tests/test_huge_pages.py runs the restart.
os.environ["GLIBC_TUNABLES"] = huge_pages.with_tunable(os.environ.get("GLIBC_TUNABLES", ""))
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
# XLA:CPU aborts a process whose devices do not all reach a collective within 40 s. On CI's
# loaded 2 cores one simulated device of the sequence classifier's dp=4 run arrived later than
# that (2026-12-02: 3 of 4 threads waiting, then SIGABRT), though a late device is not a hang:
# the same psum with one device held 6 s finishes at 600 s and aborts at 3 s. 240 s stays
# under the tests' 300 s subprocess limits, so a real hang still ends in XLA's own message.
COLLECTIVE_PATIENCE_FLAGS = (
    "--xla_cpu_collective_call_terminate_timeout_seconds=240"
    " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
)
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS} {COLLECTIVE_PATIENCE_FLAGS}".strip()
)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Start the backend now: a test whose first JAX work is an in-process command with
# `--devices 2` would otherwise start it with 2 devices for every later test of its worker.
jax.devices()

# Python's cyclic garbage collector, tuned for a process that traces hundreds of programs:
# tracing makes millions of short-lived objects, and at the default thresholds (700, 10, 10)
# test_mixed_precision + test_parity on one worker ran 2,618 young and 17 full collections,
# 3.5 s of 98.7 s. Imported modules are frozen out of every collection, and the young
# generation is collected every 50,000 allocations: 24 collections, 1.0 s, and the two modules
# took 94.0 s instead of 97.0 (2026-11-25). Garbage is still collected, only less often.
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 10)


# Modules that read the same session-cached programs and loss trajectories (tests/trainer.py):
# xdist's loadscope gives each module to one worker, and a worker without these builds them
# again (test_buckets alone took 17-25 s on another worker, 9 s beside test_parity). One scope
# puts them on one worker; every other module is still its own scope.
SHARED_PROGRAM_MODULES = (
    "test_parity.py",
    "test_explicit.py",
    "test_layouts.py",
    "test_buckets.py",
)


def pytest_xdist_make_scheduler(config, log):
    """Loadscope, with SHARED_PROGRAM_MODULES as one scope; None (xdist's own) for other modes."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedProgramScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module.rsplit("/", 1)[-1] in SHARED_PROGRAM_MODULES:
                return "tests/shared-programs"
            return super()._split_scope(nodeid)

    return SharedProgramScheduling(config, log)
