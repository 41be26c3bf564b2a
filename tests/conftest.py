"""Tests run on 8 simulated CPU devices; this must happen before JAX starts its backend.

XLA:CPU compiles without LLVM's optimizations and with its older emitters here: the tests'
programs are tiny and run a few steps each, so compiling is most of their time, and this
halves it. The optimized HLO (collectives, buffer assignment, memory figures) is the same;
only the generated machine code is slower. Subprocesses the tests start inherit it."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
