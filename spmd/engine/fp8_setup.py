"""What --precision fp8 asks of a build: the compositions it refuses (exit 2, naming what is
not supported), the device it needs, the size of the delayed-scaling state, and the losses
traced with the blocks' matmuls in fp8 (spmd.parallel.fp8_context)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from spmd.engine import precision
from spmd.errors import UsageError
from spmd.model_shape import STACKS
from spmd.parallel import fp8_context
from spmd.parallel.layout import Layout

if TYPE_CHECKING:
    from collections.abc import Callable

    from spmd.engine.options import StepOptions

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first NVIDIA GPUs with fp8 tensor cores


def checked_policy(
    policy: precision.Policy,
    names: Any,
    shapes: Any,
    layout: Layout,
    options: StepOptions,
    pipelined: bool,
) -> precision.Policy:
    """`policy` with its fp8 settings sized for the model (the stacked layers the delayed
    history holds), or UsageError for what fp8 does not support here."""
    if policy.fp8 is None:
        return policy
    settings = policy.fp8
    check_device(settings, layout.mesh)
    if settings.all_gather:
        if layout.zero_stage != 3 or layout.mesh.shape["fsdp"] < 2:
            raise UsageError(
                f"--fp8-all-gather gathers ZeRO-3's params; this run has zero stage "
                f"{layout.zero_stage} over fsdp={layout.mesh.shape['fsdp']} (use --zero 3 and "
                f"fsdp >= 2, or leave --fp8-all-gather off)"
            )
        if options.executor != "explicit":
            raise UsageError(
                "--fp8-all-gather needs --collectives explicit (under auto, XLA's partitioner "
                "places the gathers and would gather the dequantized bf16 weights)"
            )
    if settings.recipe == "delayed":
        refused = {
            "--accum > 1": options.accum > 1,
            "pp > 1": pipelined,
            "DiLoCo": bool(options.exclude_axes),
        }
        for what, applies in refused.items():
            if applies:
                raise UsageError(
                    f"--fp8-recipe delayed does not support {what} (the amax history is "
                    f"updated once per step, outside any scan); use tensorwise or rowwise"
                )
    return dataclasses.replace(
        policy, fp8=dataclasses.replace(settings, layers=_layers(names, shapes))
    )


def check_device(settings: fp8_context.Fp8Settings, mesh: jax.sharding.Mesh) -> None:
    """UsageError on a GPU without fp8 units unless emulation was asked for (a CPU emulates:
    XLA:CPU converts fp8 operands and multiplies in fp32)."""
    device = mesh.devices.flat[0]
    if device.platform != "gpu" or settings.emulate:
        return
    capability = getattr(device, "compute_capability", "")
    try:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
    except ValueError:
        return  # not CUDA (ROCm reports no compute capability): let XLA decide
    if (major, minor) < FP8_CAPABILITY:
        raise UsageError(
            f"--precision fp8 needs fp8 tensor cores (compute capability 8.9 or higher); "
            f"{device.device_kind} has {major}.{minor}: use --precision bf16, or --fp8-emulate"
        )


def emulated(mesh: jax.sharding.Mesh, settings: fp8_context.Fp8Settings) -> bool:
    """Whether this run's fp8 dots are emulated (a CPU, or --fp8-emulate on a GPU)."""
    return mesh.devices.flat[0].platform != "gpu" or settings.emulate


def block_matmuls(
    make_model: Callable[[int], Any], loss: Callable[[Any, Any], Any], settings: Any
) -> list[tuple[int, int]]:
    """(k, n) of one stacked block's matmuls of the model `make_model(seed)` builds, each one
    the fp8 size rule decides on (spmd.parallel.fp8_context.site), found by tracing `loss`
    abstractly on one sequence of 8 tokens: nothing is allocated or compiled."""

    def forward() -> Any:
        tokens = jax.numpy.zeros((1, 8), jax.numpy.int32)
        return loss(make_model(0), {"inputs": tokens, "targets": tokens})

    with nnx.use_eager_sharding(False):
        return fp8_context.block_matmuls(lambda: jax.eval_shape(forward), settings)


def _layers(names: Any, shapes: Any) -> int:
    """The stacked layers of the model: the leading dim of its params named `layers`, summed
    over its stacks (an MoE's sparse and dense-MLP layers are two: models/layer_groups.py),
    each found by the key above it in the params' paths."""
    with_paths = jax.tree_util.tree_flatten_with_path(shapes)[0]
    per_stack: dict[str, int] = {}
    for (path, shape), axes in zip(
        with_paths, jax.tree.leaves(names, is_leaf=_is_names), strict=True
    ):
        if axes and axes[0] == "layers":
            keys = [str(getattr(k, "key", "")) for k in path]
            stack = next((k for k in keys if k in STACKS), STACKS[0])
            per_stack[stack] = max(per_stack.get(stack, 0), shape.shape[0])
    return sum(per_stack.values())


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple)


def in_fp8(losses: Any, policy: precision.Policy) -> Any:
    """`losses` (spmd.engine.step's global and local loss) traced under the policy's fp8
    settings (unchanged without fp8)."""
    if policy.fp8 is None:
        return losses

    def wrapped(loss: Any) -> Any:
        def traced(params: Any, batch: Any) -> Any:
            with fp8_context.use(policy.fp8):
                return loss(params, batch)

        return traced

    return losses._replace(
        global_loss=wrapped(losses.global_loss), local_loss=wrapped(losses.local_loss)
    )


def device_line(
    mesh: jax.sharding.Mesh,
    settings: fp8_context.Fp8Settings,
    matmuls: list[tuple[int, int]],
) -> str | None:
    """The run's line on where its fp8 dots run and how its MFU is counted; None where none of
    the block's `matmuls` (their (k, n), `block_matmuls`) reaches fp8: the precision line then
    says that nothing runs in fp8, and a line on fp8's rate would contradict it."""
    if not any(fp8_context.reaches(settings, k, n) for k, n in matmuls):
        return None
    device = mesh.devices.flat[0]
    mfu = (
        "MFU is reported against the bf16 peak (bf16-equivalent, as torchtitan and Megatron "
        "report fp8 runs), so a step at fp8's 2x rate can exceed what bf16 could reach"
    )
    if emulated(mesh, settings):
        return (
            f"fp8 emulated on {device.platform} ({device.device_kind}): the e4m3 / e5m2 operands "
            f"are converted and multiplied in fp32, fp8's numerics without its speed; {mfu}"
        )
    capability = getattr(device, "compute_capability", "?")
    return f"fp8 on {device.device_kind}'s tensor cores (compute capability {capability}); {mfu}"
