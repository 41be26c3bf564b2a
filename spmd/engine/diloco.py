"""DiLoCo: data-parallel replicas that take H local steps, then exchange one pseudo-gradient.

Synchronous data parallelism all-reduces the gradients over the `data` axis every step. Under
`--dcn-sync diloco` every way of the `data` axis is an independent replica (on several hosts:
one host's devices each, the `--dcn-mesh dp=N` ways): it takes `--sync-every` H inner optimizer
steps on its own rows of the global batch, its gradients reduced only inside its group (the
fsdp / tensor axes, any ZeRO stage). Every H-th step ends the round: the pseudo-gradient
(start-of-round params - the replica's params) is averaged over the replicas by one all-reduce
of the fp32 params and applied by the outer optimizer (SGD with Nesterov momentum, fp32, its
state sharded like the params); every replica restarts from the result and keeps its own inner
optimizer state (Douillard et al. 2023, "DiLoCo").

How: the inner TrainState gets a leading replica dimension sharded over `data`, and the
ordinary auto-executor step (spmd.engine.step) runs under `jax.vmap(spmd_axis_name="data")`, so
nothing inside it reduces over `data`. Two compiled programs share the state's layout: `local`
(an inner step; only a few metric scalars cross the replicas) and `synced` (an inner step, then
the outer step: the one all-reduce of the round). With H = 1, outer lr 1 and momentum 0 this is
synchronous data parallelism whenever the inner optimizer is linear in the gradient (SGD, with
or without momentum); AdamW's per-replica normalisation makes H = 1 a (slightly) different
algorithm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spmd.engine import precision
from spmd.engine.options import DEFAULTS, StepOptions
from spmd.engine.state_layout import optimizer_shardings
from spmd.engine.step import Program, TrainState, build_program, once_options
from spmd.errors import UsageError
from spmd.parallel.layout import Layout
from spmd.sections import ParallelConfig, choices

AXIS = "data"  # the mesh axis whose ways are the replicas
MODES = choices(ParallelConfig, "dcn_sync")


@dataclasses.dataclass(frozen=True)
class Sync:
    """The outer loop: `every` inner steps per round (H), the outer SGD's lr and Nesterov
    momentum."""

    every: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


def outer_optimizer(sync: Sync) -> optax.GradientTransformation:
    """SGD with Nesterov momentum (plain SGD at momentum 0), applied to the pseudo-gradient."""
    if sync.outer_momentum == 0:
        return optax.sgd(sync.outer_lr)
    return optax.sgd(sync.outer_lr, momentum=sync.outer_momentum, nesterov=True)


def check(
    sync: Sync, layout: Layout, executor: str, policy: precision.Policy, pipeline_stages: int
) -> None:
    """UsageError for a DiLoCo run that cannot work or that this module does not support."""
    if sync.every < 1:
        raise UsageError(f"--sync-every {sync.every} must be a positive number of inner steps")
    if not (math.isfinite(sync.outer_lr) and sync.outer_lr > 0):
        raise UsageError(f"--outer-lr {sync.outer_lr:g} must be a positive, finite learning rate")
    if not 0 <= sync.outer_momentum < 1:
        raise UsageError(f"--outer-momentum {sync.outer_momentum:g} must be in [0, 1)")
    replicas = layout.mesh.shape[AXIS]
    if replicas < 2:
        raise UsageError(
            f"--dcn-sync diloco makes each way of the data axis a replica, but --mesh has "
            f"dp={replicas}; give the mesh dp=2 or more (e.g. --mesh dp=2,fsdp=4)"
        )
    refusals = {
        "--collectives explicit": executor != "auto",
        "--precision fp16 (per-replica loss scales)": policy.loss_scaling,
        f"pp={pipeline_stages}": pipeline_stages > 1,
    }
    for what, refused in refusals.items():
        if refused:
            raise UsageError(
                f"--dcn-sync diloco does not support {what}; use the auto executor, fp32 or "
                f"bf16, and no pipeline axis, or --dcn-sync every-step"
            )


def check_mesh(axis: str, n_processes: int, dcn: dict[str, int] | None, sizes: dict) -> None:
    """UsageError unless the replicas are the data axis: on one process only when asked for
    (--diloco-axis data), across processes when the data axis is exactly what crosses hosts."""
    if axis not in ("", AXIS):
        raise UsageError(f"--diloco-axis {axis!r} is not supported; the replicas' axis is data")
    if n_processes == 1:
        if axis != AXIS:
            raise UsageError(
                "--dcn-sync diloco on one process needs --diloco-axis data (the data axis's "
                "ways become the replicas; across hosts they are the --dcn-mesh dp ways)"
            )
        return
    crossing = {a: w for a, w in (dcn or {}).items() if w > 1}
    if crossing != {AXIS: sizes[AXIS]}:
        raise UsageError(
            f"--dcn-sync diloco needs exactly the data axis across hosts, all of its "
            f"{sizes[AXIS]} ways (one replica per host group), not {crossing}; use --mesh "
            f"dp={n_processes},... with --dcn-mesh dp={n_processes}"
        )


def _stacked(sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(sharding.mesh, PartitionSpec(AXIS, *sharding.spec))


def _stack_abstract(tree: Any, replicas: int) -> Any:
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(
            (replicas, *s.shape), s.dtype, sharding=_stacked(s.sharding)
        ),
        tree,
    )


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda s: s.sharding, tree)


@dataclasses.dataclass
class Compiled:
    """The two compiled programs of a run; `for_step(step)` picks the one of optimizer step
    `step` (1-based): `synced` ends every round. Other attributes are `synced`'s."""

    local: Any  # jax.stages.Compiled, whose __call__ is untyped
    synced: Any
    every: int

    def for_step(self, step: int) -> Any:
        return self.synced if step % self.every == 0 else self.local

    def __getattr__(self, name: str) -> Any:
        return getattr(self.synced, name)


@dataclasses.dataclass
class DilocoProgram:
    """A Program-like bundle for DiLoCo: the state is a TrainState whose params, loss scale and
    opt_state["inner"] have a leading replica dimension; opt_state["outer"] holds the
    start-of-round params and the outer optimizer state. Steps take (params, opt_state,
    loss_scale, batch) like Program's; `step(state, batch, step)` picks local or synced."""

    inner: Program  # the per-replica program (no replica dimension)
    sync: Sync
    replicas: int
    abstract_params: Any
    abstract_opt_state: Any
    abstract_loss_scale: Any
    init: Callable[[], TrainState]
    start: Callable[[Any], TrainState]  # master weights (unstacked) -> the state of step 0
    from_checkpoint: Callable[[dict], TrainState]
    local_step: jax.stages.Wrapped
    synced_step: jax.stages.Wrapped
    eval_step: jax.stages.Wrapped  # (stacked params, batch) -> loss of the replicas' mean params

    def __getattr__(self, name: str) -> Any:  # layout, policy, accum, names, graphdef, ...
        return getattr(self.inner, name)

    @property
    def abstract_master(self) -> Any:
        return self.inner.abstract_master

    def step(self, state: TrainState, batch: dict, step: int) -> tuple[TrainState, dict]:
        """Optimizer step `step` (1-based): a local step, or a synced one every H-th step."""
        fn = self.synced_step if step % self.sync.every == 0 else self.local_step
        *new_state, metrics = fn(*state, batch)
        return TrainState(*new_state), metrics

    def checkpoint_view(self, state: Any) -> dict[str, Any]:
        """ "params": the start-of-round (outer) params, fp32; "outer_opt": the outer optimizer
        state; "replicas": each replica's fp32 master weights, inner optimizer state and loss
        scale. With the step number (the position in the round) that is the whole state."""
        state = TrainState(**state) if isinstance(state, dict) else TrainState(*state)
        outer = state.opt_state["outer"]
        master, rest = precision.split_opt_state(
            state.params, state.opt_state["inner"], self.inner.policy
        )
        replicas = {"params": master, "opt_state": rest, "loss_scale": state.loss_scale}
        return {"params": outer["params"], "outer_opt": outer["opt"], "replicas": replicas}

    def abstract_checkpoint(self) -> dict[str, Any]:
        abstract = TrainState(
            self.abstract_params, self.abstract_opt_state, self.abstract_loss_scale
        )
        return self.checkpoint_view(abstract)

    def compile_train_step(self, global_batch: int, seq_len: int) -> Compiled:
        """Lower and compile both programs for a batch shape (the local one only when H > 1)."""
        args = (
            self.abstract_params,
            self.abstract_opt_state,
            self.abstract_loss_scale,
            self.inner.abstract_batch(global_batch, seq_len),
        )
        synced = self.synced_step.lower(*args).compile()
        local = self.local_step.lower(*args).compile() if self.sync.every > 1 else synced
        return Compiled(local, synced, self.sync.every)


def build(
    make_model: Callable[[int], Any],
    loss_fn: Callable,
    tx: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    layout: Layout,
    sync: Sync,
    options: StepOptions = DEFAULTS,
    **overrides: Any,
) -> DilocoProgram:
    """The DiLoCo program of a model (arguments as spmd.engine.step.build_program's) whose
    replicas are the ways of the layout's data axis (offload refused: build_program says why)."""
    options = dataclasses.replace(options, **overrides) if overrides else options
    check(sync, layout, options.executor, options.policy, layout.mesh.shape["pipeline"])
    inner_options = dataclasses.replace(options, exclude_axes=(AXIS,))
    inner = build_program(make_model, loss_fn, tx, layout, inner_options)
    outer_tx = outer_optimizer(sync)
    abstract = _abstract_state(inner, outer_tx, layout)
    state_sh = TrainState(*(_shardings(a) for a in abstract))
    init, start, from_checkpoint = _state_makers(inner, outer_tx, layout.mesh.shape[AXIS])
    local_step, synced_step, eval_step = _steps(inner, outer_tx, layout)
    batch_sh, replicated = layout.batch_sharding(ndim=1), layout.replicated
    step_in = (*state_sh, batch_sh)
    step_out = (*state_sh, replicated)
    once = once_options(layout.mesh)
    return DilocoProgram(
        inner=inner,
        sync=sync,
        replicas=layout.mesh.shape[AXIS],
        abstract_params=abstract.params,
        abstract_opt_state=abstract.opt_state,
        abstract_loss_scale=abstract.loss_scale,
        init=jax.jit(init, out_shardings=state_sh, compiler_options=once),
        start=jax.jit(start, out_shardings=state_sh, compiler_options=once),
        from_checkpoint=jax.jit(from_checkpoint, out_shardings=state_sh, compiler_options=once),
        local_step=jax.jit(
            local_step, in_shardings=step_in, out_shardings=step_out, donate_argnums=(0, 1, 2)
        ),
        synced_step=jax.jit(
            synced_step, in_shardings=step_in, out_shardings=step_out, donate_argnums=(0, 1, 2)
        ),
        eval_step=jax.jit(
            eval_step, in_shardings=(state_sh.params, batch_sh), out_shardings=replicated
        ),
    )


def _abstract_state(
    inner: Program, outer_tx: optax.GradientTransformation, layout: Layout
) -> TrainState:
    """The DiLoCo state as ShapeDtypeStructs with shardings: the inner state stacked over the
    replicas; beside the inner optimizer state, the outer one (the start-of-round fp32 params
    and the outer momentum, sharded like the params)."""
    replicas = layout.mesh.shape[AXIS]
    master_abs = inner.abstract_master
    param_sh = _shardings(master_abs)
    outer_opt_shapes = jax.eval_shape(outer_tx.init, master_abs)
    outer_opt_sh = optimizer_shardings(outer_opt_shapes, param_sh, layout.replicated)
    outer_opt = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        outer_opt_shapes,
        outer_opt_sh,
    )
    return TrainState(
        _stack_abstract(inner.abstract_params, replicas),
        {
            "inner": _stack_abstract(inner.abstract_opt_state, replicas),
            "outer": {"params": master_abs, "opt": outer_opt},
        },
        _stack_abstract(inner.abstract_loss_scale, replicas),
    )


def _state_makers(
    inner: Program, outer_tx: optax.GradientTransformation, replicas: int
) -> tuple[Callable, Callable, Callable]:
    """(init, start(master weights), from_checkpoint(saved tree)) of the DiLoCo state: every
    replica starts from the same inner state; the outer state starts at the master weights."""
    policy = inner.policy

    def start(master: Any) -> TrainState:
        master = precision.cast(master, jnp.float32)
        state = inner.makers.start(master)
        params, opt_state, loss_scale = jax.tree.map(
            lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), state
        )
        outer = {"params": master, "opt": outer_tx.init(master)}
        return TrainState(params, {"inner": opt_state, "outer": outer}, loss_scale)

    def init() -> TrainState:
        params, opt_state, _ = inner.makers.init()
        return start(precision.split_opt_state(params, opt_state, policy)[0])

    def from_checkpoint(saved: dict) -> TrainState:
        rep = saved["replicas"]
        opt_state = {
            "inner": precision.join_opt_state(rep["params"], rep["opt_state"], policy),
            "outer": {"params": saved["params"], "opt": saved["outer_opt"]},
        }
        params = precision.cast(rep["params"], policy.param_dtype)
        return TrainState(params, opt_state, rep["loss_scale"])

    return init, start, from_checkpoint


def _steps(
    inner: Program, outer_tx: optax.GradientTransformation, layout: Layout
) -> tuple[Callable, Callable, Callable]:
    """(local_step, synced_step, eval_step) before jit: an inner step on every replica at once;
    the same followed by the outer step; the loss of the replicas' mean params."""
    mesh, replicas, policy = layout.mesh, layout.mesh.shape[AXIS], inner.policy
    param_sh = _shardings(inner.abstract_master)
    master_sh = jax.tree.map(_stacked, param_sh)
    within = tuple(a for a in ("fsdp",) if mesh.shape[a] > 1)
    per_replica = jax.vmap(inner.train_fn, spmd_axis_name=AXIS)

    def split_rows(x: jax.Array) -> jax.Array:
        # Replica r's rows of the global batch are the block its data-axis devices hold.
        x = x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
        spec = PartitionSpec(AXIS, within or None)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def local_step(params: Any, opt_state: Any, loss_scale: Any, batch: dict) -> tuple:
        batch = jax.tree.map(split_rows, batch)
        params, inner_opt, loss_scale, metrics = per_replica(
            params, opt_state["inner"], loss_scale, batch
        )
        # Every replica's rows hold the same number of tokens: the mean of the replicas' mean
        # losses is the global batch's. These few scalars are all that crosses the replicas.
        metrics = {
            "loss": metrics["loss"].mean(),
            "grad_norm": metrics["grad_norm"].mean(),  # the mean of the replicas' local norms
            "loss_scale": metrics["loss_scale"].min(),
            "skipped_steps": metrics["skipped_steps"].max(),
        }
        return params, {"inner": inner_opt, "outer": opt_state["outer"]}, loss_scale, metrics

    def synced_step(params: Any, opt_state: Any, loss_scale: Any, batch: dict) -> tuple:
        params, opt_state, loss_scale, metrics = local_step(params, opt_state, loss_scale, batch)
        master, rest = precision.split_opt_state(params, opt_state["inner"], policy)
        outer = opt_state["outer"]
        # The round's one cross-replica collective: the mean of the replicas' fp32 params.
        pseudo_grad = jax.tree.map(
            lambda start, local: start - local.astype(jnp.float32).mean(0), outer["params"], master
        )
        pseudo_grad = jax.lax.with_sharding_constraint(pseudo_grad, param_sh)
        updates, outer_opt = outer_tx.update(pseudo_grad, outer["opt"], outer["params"])
        new = optax.apply_updates(outer["params"], updates)
        restart = jax.tree.map(lambda p: jnp.broadcast_to(p, (replicas, *p.shape)), new)
        restart = jax.lax.with_sharding_constraint(restart, master_sh)
        inner_opt = precision.join_opt_state(restart, rest, policy)
        params = precision.cast(restart, policy.param_dtype)
        opt_state = {"inner": inner_opt, "outer": {"params": new, "opt": outer_opt}}
        return params, opt_state, loss_scale, metrics

    def eval_step(params: Any, batch: dict) -> jax.Array:
        mean = jax.tree.map(lambda p: p.astype(jnp.float32).mean(0).astype(p.dtype), params)
        return inner.eval_step(mean, batch)

    return local_step, synced_step, eval_step


# What the builder returns and the training loop runs: a synchronous Program, or DiLoCo's
# (whose extra attributes reach the inner Program's through __getattr__).
AnyProgram = Program | DilocoProgram
# a compiled train step: jax's, or DiLoCo's pair (which answers as its synced program)
AnyCompiled = jax.stages.Compiled | Compiled
