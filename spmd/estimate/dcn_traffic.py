"""Cross-replica (cross-host) bytes of a `--dcn-sync diloco` run, read from its two compiled
programs (spmd.engine.diloco), beside what synchronous data parallelism would move: the
figures the train command prints at compile time, logs as `dcn_traffic` and reports in
`--dry-run`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

from spmd.engine.state_layout import sharded_bytes
from spmd.estimate import hlo
from spmd.parallel import rules

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyCompiled, Compiled, DilocoProgram


AXIS = "data"  # the replicas' mesh axis (spmd.engine.diloco.AXIS)


def cross_replica_bytes(compiled: AnyCompiled, mesh: jax.sharding.Mesh) -> int:
    """Bytes per device that one run of `compiled` moves in collectives over the data axis."""
    return sum(c.bytes * c.count for c in hlo.collectives(compiled, mesh) if AXIS in c.axes)


def traffic(program: DilocoProgram, compiled: Compiled) -> dict[str, Any]:
    """Cross-replica (cross-host) bytes per device, read from the compiled programs: per local
    step, per synced step, averaged per optimizer step, and what synchronous data parallelism
    would all-reduce every step instead (the gradients, in the reduce dtype, per device)."""
    mesh, every = program.layout.mesh, program.sync.every
    local = cross_replica_bytes(compiled.local, mesh) if every > 1 else 0
    synced = cross_replica_bytes(compiled.synced, mesh)
    inner = program.inner
    grad_sh = rules.tree_shardings(
        inner.names, inner.abstract_params, mesh, inner.layout.zero_stage, "grads"
    )
    grads = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, inner.policy.reduce_dtype, sharding=sh),
        inner.abstract_params,
        grad_sh,
    )
    return {
        "replicas": program.replicas,
        "sync_every": every,
        "local_step_bytes": local,
        "synced_step_bytes": synced,
        "params_bytes": sharded_bytes(inner.abstract_master),
        "bytes_per_step": ((every - 1) * local + synced) / every,
        "every_step_bytes": sharded_bytes(grads),
    }


def format_traffic(t: dict[str, Any]) -> str:
    """One line: the cross-host bytes per optimizer step of DiLoCo beside every-step sync."""
    mib = 2**20
    ratio = t["every_step_bytes"] / max(t["bytes_per_step"], 1)
    return (
        f"diloco: {t['replicas']} replicas over the data axis, sync every {t['sync_every']} "
        f"steps | cross-replica bytes per device: {t['synced_step_bytes'] / mib:.3f} MiB per "
        f"sync (params {t['params_bytes'] / mib:.3f} MiB), {t['local_step_bytes']} B per "
        f"local step -> {t['bytes_per_step'] / mib:.3f} MiB per optimizer step vs "
        f"{t['every_step_bytes'] / mib:.3f} MiB of gradients every step when synchronous "
        f"({ratio:.1f}x less)"
    )
