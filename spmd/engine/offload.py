"""Host offload of the train state (`--offload`): which parts of the state live in host memory
between steps, and the step that streams them to the devices for its work.

`optimizer`: the optimizer state (Adam's moments; under bf16 / fp16 also the fp32 master
weights, which the optimizer state holds) lives in the host's pinned memory, sharded as the
ZeRO stage lays it out. `params`: the working params too (under fp32 they are the master
weights). The jitted step takes those arrays in `pinned_host` and gives them back there; inside,
it moves them to device memory (`jax.device_put` to the device memory kind) before it computes,
and XLA moves the results back to the host because the step's out_shardings say so. That is
what MaxText's optimizer and parameter host offload do; DeepSpeed's ZeRO-Offload instead runs
the Adam update on the CPU. The state's shardings (what each device holds) do not change, only
the memory they are in.

On XLA:CPU every memory is host RAM: the compiled step marks the offloaded arguments and
results as host memory (memory space S(5) in its entry layout) and the arrays carry
`memory_kind="pinned_host"`, but a `device_put` inside the jit lowers to nothing there
(docs/jax-facts.md). Units: bytes per device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding

from spmd.engine.state_layout import HasAbstractState, sharded_bytes, state_bytes_per_device
from spmd.errors import UsageError
from spmd.sections import ParallelConfig, choices

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyCompiled

OFFLOADS = choices(ParallelConfig, "offload")
HOST = "pinned_host"
DEVICE = "device"
# the roles of the train state each --offload keeps in host memory
HOST_ROLES = {"none": (), "optimizer": ("opt_state",), "params": ("opt_state", "params")}


def check(offload: str, zero: int, pipelined: bool, vmapped: bool) -> None:
    """UsageError for an --offload value or a combination the engine cannot run: params
    offload needs ZeRO-3 (each device then keeps only its shard of the params on the host, as
    FSDP's CPU offload); pipelines (pp > 1) and DiLoCo (whose replicas vmap the step,
    `vmapped`) are not offloaded."""
    if offload not in OFFLOADS:
        raise UsageError(f"--offload {offload!r} is not one of {', '.join(OFFLOADS)}")
    if offload == "none":
        return
    if offload == "params" and zero != 3:
        raise UsageError(
            f"--offload params keeps each device's shard of the params on the host, which "
            f"needs --zero 3 (got --zero {zero}); use --zero 3 or --offload optimizer"
        )
    if pipelined:
        raise UsageError(
            f"--offload {offload} does not run with a pipeline (pp > 1); use pp=1 or --offload none"
        )
    if vmapped:
        raise UsageError(
            f"--offload {offload} does not run with --dcn-sync diloco; use --dcn-sync every-step "
            f"or --offload none"
        )


def placed(shardings: dict[str, Any], offload: str) -> dict[str, Any]:
    """`shardings` (spmd.engine.state_layout.state_shardings' roles) with the roles that
    `offload` keeps on the host in host memory; the others as they are."""
    out = dict(shardings)
    for role in HOST_ROLES[offload]:
        out[role] = in_memory(shardings[role], HOST)
    return out


def in_memory(shardings: Any, kind: str) -> Any:
    """Every NamedSharding of the tree `shardings` in memory kind `kind`."""
    return jax.tree.map(
        lambda s: s.with_memory_kind(kind),
        shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def to_device(tree: Any, shardings: Any) -> Any:
    """`tree` (traced, laid out by `shardings`) moved to device memory; leaves whose sharding
    is already the device's stay as they are."""

    def move(x: jax.Array, s: NamedSharding) -> jax.Array:
        if s.memory_kind in (None, DEVICE):
            return x
        return jax.device_put(x, s.with_memory_kind(DEVICE))

    return jax.tree.map(move, tree, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def streamed_train_step(train_step: Callable, state_shardings: Any) -> Callable:
    """`train_step(params, opt_state, loss_scale, batch)` whose state arguments, where
    `state_shardings` (a TrainState of sharding trees) put them in host memory, are moved to
    the devices first. The results go back to the host through the jit's out_shardings. The
    wrapper keeps train_step's name: the compiled module stays `jit_train_step`, which the
    profiler's breakdown looks for."""

    @functools.wraps(train_step)
    def step(params: Any, opt_state: Any, loss_scale: Any, batch: Any) -> Any:
        params = to_device(params, state_shardings.params)
        opt_state = to_device(opt_state, state_shardings.opt_state)
        return train_step(params, opt_state, loss_scale, batch)

    return step


def streamed_eval_step(eval_step: Callable, param_shardings: Any) -> Callable:
    """`eval_step(params, batch)` with host-resident params moved to the devices first."""

    @functools.wraps(eval_step)
    def step(params: Any, batch: Any) -> Any:
        return eval_step(to_device(params, param_shardings), batch)

    return step


def bytes_by_memory(abstract: Any) -> dict[str, int]:
    """{"device": bytes, "host": bytes} one device holds of a pytree of sharded
    ShapeDtypeStructs (or arrays), split by the memory kind of each leaf's sharding."""
    leaves = jax.tree.leaves(abstract)
    host = sharded_bytes([x for x in leaves if x.sharding.memory_kind in (HOST, "unpinned_host")])
    return {DEVICE: sharded_bytes(leaves) - host, "host": host}


def state_bytes_by_memory(
    compiled: AnyCompiled, program: HasAbstractState
) -> dict[str, dict[str, int]]:
    """{"params" | "opt_state": {"device": bytes, "host": bytes}} one device holds, read from
    the shardings (and their memory kinds) the compiled train step takes its state in."""
    return state_bytes_per_device(compiled, program, bytes_by_memory)


def totals(by_memory: dict[str, dict[str, int]]) -> dict[str, int]:
    """{"device": bytes, "host": bytes} of all the state one device keeps (of
    `state_bytes_by_memory`: its roles summed)."""
    return {where: sum(roles[where] for roles in by_memory.values()) for where in (DEVICE, "host")}


def device_peak(memory: dict[str, int], host_bytes: int) -> int | None:
    """XLA's per-device peak estimate (spmd.estimate.hlo.memory) without the state kept in host
    memory. XLA:GPU and TPU report host arguments apart (host_argument_size_in_bytes); XLA:CPU
    counts them in the argument and output bytes (its host_* figures are 0), so there the
    offloaded state (an argument aliased to its output) is taken out of the estimate here."""
    peak = memory.get("peak_estimate")
    if peak is None:
        return None
    reported_apart = memory.get("host_argument", 0) > 0
    return peak if reported_apart else peak - host_bytes


def describe(by_memory: dict[str, dict[str, int]], offload: str) -> str:
    """The compile line's tail under --offload: what of the state one device keeps in host
    memory, in MiB ("" without offload)."""
    if offload == "none":
        return ""
    host = ", ".join(
        f"{name} {by_memory[role]['host'] / 2**20:.2f} MiB"
        for role, name in (("params", "params"), ("opt_state", "optimizer state"))
        if by_memory[role]["host"]
    )
    return f" | --offload {offload}: in host memory {host}"
