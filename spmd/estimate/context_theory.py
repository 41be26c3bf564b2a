"""The dry run's expected collectives of context parallelism (spmd.estimate.theory re-exports
them): ring attention's collective-permutes, key and value blocks passed cp − 1 times per layer
and pass, or under --cp-mode ulysses (spmd.parallel.ulysses) 4 all-to-alls per layer and pass
(q, k, v and the output; their gradients back). The per-message arithmetic is
spmd.estimate.volumes'.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from spmd.estimate import volumes
from spmd.model_shape import ModelShape
from spmd.parallel.mesh import BATCH_AXES

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyProgram


def _element_bytes(program: AnyProgram) -> int:
    """Bytes per element of the program's compute dtype (theory.activation_bytes)."""
    return np.dtype(program.policy.compute_dtype).itemsize


def ring_sends(
    model: ModelShape, mesh: Any, accum: int, global_batch: int, seq_len: int, element_bytes: int
) -> tuple[int, int]:
    """(count, bytes per device) of ring attention's collective-permutes in one step, key and
    value blocks of `element_bytes` per element (spmd.estimate.volumes: per layer, pass and
    micro-batch 2(cp − 1) blocks)."""
    context, tensor = mesh.shape["context"], mesh.shape["tensor"]
    rows = global_batch // math.prod(mesh.shape[a] for a in BATCH_AXES) // accum
    block = volumes.kv_block_bytes(model, rows, seq_len, context, tensor, element_bytes)
    passes = volumes.ring_passes(model.remat != "none", pipelined=False)
    sends = volumes.ring_sends(context, model.n_layers, passes, accum)
    return sends, round(sends * block)


def ulysses(program: AnyProgram) -> bool:
    """Whether attention crosses the context split by Ulysses' all-to-alls (--cp-mode)."""
    return getattr(program.layout, "cp_mode", "ring") == "ulysses"


def ulysses_all_to_alls(
    program: AnyProgram,
    model: ModelShape,
    global_batch: int,
    seq_len: int,
    pipeline: dict | None = None,
) -> tuple[int, int]:
    """(count, result bytes per device) of Ulysses' all-to-alls in one step: 4 per layer and
    pass (q, k, v, output; their gradients back), the passes as the ring's, per micro-batch
    (or, under a pipeline, per tick over one chunk's layers: the stages run in lockstep)."""
    mesh = program.layout.mesh
    if pipeline is None:
        rows = global_batch // program.layout.data_parallel // program.accum
        layers, executions = model.n_layers, program.accum
    else:
        rows = global_batch // (program.layout.data_parallel * pipeline["microbatches"])
        layers = model.n_layers // (pipeline["stages"] * pipeline["virtual"])
        executions = pipeline["ticks"]
    per_layer = volumes.ulysses_layer_bytes(
        model, rows, seq_len, mesh.shape["context"], mesh.shape["tensor"], _element_bytes(program)
    )
    passes = volumes.ring_passes(model.remat != "none", pipelined=pipeline is not None)
    calls = executions * layers * passes
    return 4 * calls, round(calls * per_layer)


def pipelined_ring_sends(
    program: AnyProgram, model: ModelShape, pipeline: dict, global_batch: int, seq_len: int
) -> dict[str, int]:
    """{"count", "bytes"} of the ring's collective-permutes per device per step inside a
    pipeline schedule (`pipeline`: its summary) as spmd.estimate.hlo counts them: per tick a
    forward slot (one pass over a chunk) and a backward slot (the recomputed forward, the
    backward, + a remat replay). Stages run slots in lockstep (spmd.parallel.pipeline_stage),
    so one executes wherever some stage has work: an idle stage's sends ride the bubble."""
    mesh = program.layout.mesh
    context = mesh.shape["context"]
    if context == 1 or ulysses(program):
        return {"count": 0, "bytes": 0}
    rows = global_batch // (program.layout.data_parallel * pipeline["microbatches"])
    chunk = model.n_layers // (pipeline["stages"] * pipeline["virtual"])
    block = volumes.kv_block_bytes(
        model, rows, seq_len, context, mesh.shape["tensor"], _element_bytes(program)
    )
    passes = volumes.ring_passes(model.remat != "none", pipelined=True)
    sends = volumes.ring_sends(context, chunk, passes, pipeline["ticks"])
    return {"count": sends, "bytes": round(sends * block)}
