"""Compile spmd's programs for an NVIDIA H100 (sm_90) on a machine without a GPU, and report
what XLA:GPU made of them: the matmuls (cuBLAS calls, fp8 or not; Triton gemm fusions and their
operand types), cuDNN attention and the step's memory.

This is XLA's ahead-of-time ("deviceless") compilation through jax's CUDA plugin: no kernel
runs, so it says nothing of time, and no autotuning happens (Triton gemms keep a default tile,
cuBLAS calls an unset algorithm; on a GPU the autotuner may swap one for the other). What it
does show is the program a GPU would run: which dots are fp8, what is fused, what is copied.

Setup, once (a venv beside the project's install; the plugin's version must be jaxlib's):

    python -m venv --system-site-packages /tmp/gpuvenv
    /tmp/gpuvenv/bin/pip install "jax-cuda12-plugin[with-cuda]==0.10.2"   # jaxlib's version

Run from the repository root; JAX_PLATFORMS=cpu is required (without it the plugin initialises
CUDA, fails with no device and registers nothing; with it the compile-only H100 target below is
still available):

    JAX_PLATFORMS=cpu /tmp/gpuvenv/bin/python benchmarks/h100_compile.py fp8
    JAX_PLATFORMS=cpu /tmp/gpuvenv/bin/python benchmarks/h100_compile.py train \\
        --config configs/1b.toml --precision bf16 --remat none --batch 8 --seq-len 2048
    JAX_PLATFORMS=cpu /tmp/gpuvenv/bin/python benchmarks/h100_compile.py train \\
        --config configs/1b.toml --precision bf16 --remat none --document-mask on

XLA_FLAGS pass through (e.g. --xla_gpu_enable_triton_gemm=false: every dot a cuBLAS call);
spmd.train's GPU flags (spmd.parallel.xla_flags, the throughput preset) are added as spmd.train
adds them on a GPU host. Measured figures: docs/speed.md and docs/strategies/fp8.md.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # spmd and models, as run
# An H100 SXM as XLA:GPU's GpuTargetConfigProto describes a device (public hardware figures).
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
CAPABILITY = (9, 0)


def h100_mesh(axes: tuple[str, ...]):
    """A one-device mesh of a compile-only H100 with `axes` (each of size 1)."""
    import jax
    import numpy as np
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x1")
    devices = np.array(topology.devices[:1]).reshape((1,) * len(axes))
    return jax.sharding.Mesh(devices, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def trace_as_gpu() -> None:
    """Make the tracing side believe it runs on the H100: models/attention.py picks cuDNN's
    flash attention and models/moe_dispatch.py its GPU grouped matmul where
    jax.default_backend() is "gpu", and jax's cuDNN attention checks the local GPU's compute
    capability (there is none)."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    import models.attention as attention
    import models.grouped_matmul as grouped_matmul
    import models.moe_dispatch as moe_dispatch

    class OnGpu(types.ModuleType):
        def __getattr__(self, name: str):
            return getattr(jax, name)

    h100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", core_count=132)
    on_gpu = OnGpu("jax")
    on_gpu.default_backend = lambda: "gpu"  # type: ignore[attr-defined]
    on_gpu.devices = lambda *_: [h100]  # type: ignore[attr-defined]
    # the modules that pick a kernel per platform, and the Mosaic kernel that sizes its grid
    # by the device's cores
    for chooser in (attention, moe_dispatch, grouped_matmul, transposed_ragged_dot_mgpu):
        chooser.jax = on_gpu  # type: ignore[attr-defined]
    version = lambda text: tuple(int(x) for x in text.split("."))  # noqa: E731
    cudnn_attention.check_compute_capability = lambda c: CAPABILITY >= version(c)
    cudnn_attention.is_cuda_compute_capability_equal = lambda c: CAPABILITY == version(c)


def square_buffers(compiled, length: int) -> int:
    """Instructions of the optimized program whose result has two dims of `length` (an
    attention's length x length scores or probabilities); 0 where attention stays fused."""
    from spmd.estimate import hlo

    pattern = re.compile(rf"\b{length},(\d+,)*{length}\b")
    return sum(1 for _, _, shape, *_ in hlo.instructions(compiled) if pattern.search(shape))


def summary(compiled) -> dict:
    """What the optimized GPU program holds: custom calls and Triton matmul fusions executed
    per step (loop trips counted), the dots by operand and result types (each once, fused or
    not) and the memory per device."""
    from spmd.estimate import hlo

    calls: collections.Counter = collections.Counter()
    for _, _, _, opcode, attrs, runs in hlo.instructions(compiled):
        target = re.search(r'custom_call_target="([^"]+)"', attrs)
        if opcode == "custom-call" and target:
            calls[target.group(1)] += runs
        kind = re.search(r'"kind":"(__triton\w*gemm\w*)"', attrs)
        if opcode == "fusion" and kind:  # a Triton matmul (its epilogue fused in)
            calls[kind.group(1)] += runs
    dots = collections.Counter(f"{'x'.join(ops)}->{out}" for out, ops in hlo.dot_dtypes(compiled))
    return {
        "calls": dict(calls),
        "dots": dict(dots),
        "memory": {k: f"{v / 2**30:.2f} GiB" for k, v in hlo.memory(compiled).items()},
    }


def fp8_matmuls() -> None:
    """models.fp8.matmul (forward and both backward dots) of [4096, 4096] bf16 operands, per
    recipe."""
    import jax
    import jax.numpy as jnp

    from models import fp8
    from spmd.parallel.fp8_context import Site

    sharding = jax.sharding.NamedSharding(h100_mesh(("x",)), jax.sharding.PartitionSpec())
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    square, scales = spec((4096, 4096)), spec((3,), jnp.float32)
    for recipe in ("tensorwise", "rowwise", "delayed"):

        def loss(x, w, history, probe, dy, recipe=recipe):
            site = Site(recipe, history, probe) if recipe == "delayed" else Site(recipe)
            return (fp8.matmul(x, w, site).astype(jnp.float32) * dy).sum()

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3)))
        compiled = step.lower(square, square, scales, scales, square).compile()
        print(recipe, summary(compiled))


def train_step(argv: list[str]) -> None:
    """spmd's train step as spmd.train builds it (its flags), on one H100."""
    from spmd.parallel import xla_flags
    from spmd.parallel.mesh import MESH_AXES
    from spmd.run import builder, resolve
    from spmd.run.config import Config

    cfg = Config.of(resolve.run_config(argv, "h100_compile.py train", printable=True))
    parallel = cfg.parallel
    wanted = xla_flags.wanted("gpu", parallel.xla_preset, parallel.bucket_mb, parallel.collectives)
    # XLA reads the flags when the first backend starts: h100_mesh below, nothing before it
    os.environ["XLA_FLAGS"] = xla_flags.merge(os.environ.get("XLA_FLAGS", ""), wanted)[0]
    trace_as_gpu()  # for this process: the script runs nothing on the CPU afterwards
    # `--document-mask on`: batches with document ids, as a record corpus gives them
    fields = ("inputs", "targets", "segments") if cfg.data.document_mask == "on" else None
    mesh = h100_mesh(MESH_AXES)
    program = builder.program(cfg, mesh, fields) if fields else builder.program(cfg, mesh)
    start = time.perf_counter()
    compiled = program.lower_train_step(cfg.run.batch, cfg.run.seq_len).compile()
    from spmd.parallel.hooks import notes

    print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
    print(f"compiled in {time.perf_counter() - start:.1f} s; model choices: {notes()}")
    for key, value in summary(compiled).items():
        print(f"{key}: {value}")
    print(f"length x length buffers: {square_buffers(compiled, cfg.run.seq_len)}")


def main() -> None:
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        sys.exit("set JAX_PLATFORMS=cpu: the module docstring says why")
    mode, argv = (sys.argv[1:2] or ["fp8"])[0], sys.argv[2:]
    if mode not in ("fp8", "train"):
        sys.exit(f"mode {mode!r}: use fp8 or train")
    if mode == "fp8":
        fp8_matmuls()
    else:
        train_step(argv)


if __name__ == "__main__":
    main()
