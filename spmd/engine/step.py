"""Build the jitted, sharded train and eval steps for (model, loss, optimizer, layout).

The state is two pytrees of plain dicts: `params` (the model's nnx.Param values) and
`opt_state` (optax's), each laid out by the rules of spmd.parallel.rules for the layout's ZeRO
stage.
`jax.jit` gets those shardings as in/out shardings, donates the state buffers, and XLA's SPMD
partitioner inserts the collectives (the `auto` executor). The `explicit` executor
(spmd.engine.explicit) puts a shard_map with hand-written collectives inside the same jit;
the auto executor's steps are spmd.engine.auto's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from spmd.engine import fp8_setup, frozen, offload, precision, state_layout
from spmd.engine.abstract import abstract_model
from spmd.engine.auto import auto_steps
from spmd.engine.explicit import explicit_steps
from spmd.engine.options import DEFAULTS, TOKENS, StepOptions
from spmd.errors import UsageError
from spmd.parallel import hooks
from spmd.parallel.layout import Layout
from spmd.sections import FLOAT_FIELDS, ParallelConfig, choices

LossFn = Callable[[nnx.Module, dict[str, jax.Array]], jax.Array]
EXECUTORS = choices(ParallelConfig, "collectives")
# XLA options for the programs that make the state, which run once per run. On a CPU they
# compile without LLVM's optimizations and with XLA:CPU's older emitters: the tiny model's init
# compiled in 0.52 s instead of 3.98 and ran in 22 ms instead of 4 (the small model: 0.44 s
# against 3.50, 74 ms against 15). Its normal samples differ from the optimized code's by at
# most one ulp (2026-11-25).
ONCE_ON_CPU = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def once_options(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> dict[str, Any] | None:
    """jax.jit's compiler_options for a program that runs once per run on `mesh`."""
    return ONCE_ON_CPU if mesh.devices.flat[0].platform == "cpu" else None


class TrainState(NamedTuple):
    """Everything a train step updates: the params (a pure dict of arrays in the policy's
    working dtype), the optimizer state (with the fp32 master weights under bf16 / fp16), and
    the loss-scale state (spmd.engine.precision; constant unless fp16)."""

    params: Any
    opt_state: Any
    loss_scale: Any


@dataclasses.dataclass
class Program:
    """The compiled-on-first-use functions of one training run and the shardings they use."""

    layout: Layout
    graphdef: Any
    names: Any  # logical axis names per param (pure dict of tuples)
    abstract_params: Any  # ShapeDtypeStructs with shardings
    abstract_opt_state: Any
    abstract_loss_scale: Any  # precision.LossScale of ShapeDtypeStructs (replicated scalars)
    abstract_master: Any  # the master weights (fp32) in the params' shardings, e.g. to load
    init: Callable[[], TrainState]  # () -> the initial state, made sharded on the mesh
    start: Callable[[Any], TrainState]  # master weights -> the state of a fresh optimizer
    # the tree a checkpoint holds -> TrainState (the working params derived from the master)
    from_checkpoint: Callable[[dict], TrainState]
    # (params, opt_state, loss_scale, batch) -> (params, opt_state, loss_scale, metrics)
    train_step: jax.stages.Wrapped
    eval_step: jax.stages.Wrapped  # (params, batch) -> mean loss
    accum: int
    policy: precision.Policy
    train_fn: Callable  # train_step before jit (spmd.engine.diloco vmaps it)
    # init, start and from_checkpoint before jit, for a program that makes this state inside
    # its own (spmd.engine.diloco): the jitted ones carry compiler options, which only a
    # top-level jit may
    makers: _StateMakers
    # the keys of a batch: inputs, targets, and where the data has them "segments" (int32
    # document ids) and "weights" (float32 loss weights); spmd.io.data.TokenWindows.fields
    batch_fields: tuple[str, ...] = TOKENS
    # --prefetch asked of the explicit executor: its ZeRO-3 layer scan gathers one layer ahead
    # when the layers are rematerialised (hooks.scan_layers; theory.prefetching)
    prefetch: bool = False
    # the optimizer's (master, opt state) -> params to evaluate and export (StepOptions')
    eval_params: Callable[[Any, Any], Any] | None = None

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        """One optimizer step: (new state, metrics). `state` is donated: use the new one."""
        *new_state, metrics = self.train_step(*state, batch)
        return TrainState(*new_state), metrics

    def checkpoint_view(self, state: Any) -> dict[str, Any]:
        """What a checkpoint holds of `state` (a TrainState or a dict of its fields): "params"
        are the master weights (fp32 under every policy; the 16-bit working params are derived
        from them on restore), "opt_state" the optimizer's own state, and "loss_scale"."""
        state = state if isinstance(state, dict) else TrainState(*state)._asdict()
        master, inner = precision.split_opt_state(state["params"], state["opt_state"], self.policy)
        # frozen params (a LoRA base) are saved as held: in the working dtype
        master = frozen.join(frozen.trainable(master), frozen.split(state["params"])[1])
        view = {"params": master, "opt_state": inner, "loss_scale": state["loss_scale"]}
        if self.eval_params is not None:  # what evals, samples and exports read (fp32)
            trained, fixed = frozen.split(master)
            is_abstract = isinstance(jax.tree.leaves(trained)[0], jax.ShapeDtypeStruct)
            averaged = trained if is_abstract else self.eval_params(trained, inner)
            view["eval_params"] = frozen.join(averaged, fixed)
        return view

    def evaluated_params(self, state: Any) -> Any:
        """The params the evals and the harness of `state` read, in the working dtype: its
        params, or the optimizer's `eval_params` of them (schedule-free AdamW's average)."""
        state = state if isinstance(state, dict) else TrainState(*state)._asdict()
        if self.eval_params is None:
            return state["params"]
        return precision.cast(self.checkpoint_view(state)["eval_params"], self.policy.param_dtype)

    def abstract_checkpoint(self) -> dict[str, Any]:
        """The restore target of `checkpoint_view` on this program's mesh (resharding)."""
        abstract = TrainState(
            self.abstract_params, self.abstract_opt_state, self.abstract_loss_scale
        )
        return self.checkpoint_view(abstract)

    def model(self, params: Any) -> nnx.Module:
        """The NNX model holding `params` (sharded arrays stay sharded), e.g. for inference."""
        return nnx.merge(self.graphdef, params)

    def abstract_batch(self, global_batch: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        sharding = self.layout.batch_sharding()
        return {
            key: jax.ShapeDtypeStruct(
                (global_batch, seq_len),
                jnp.float32 if key in FLOAT_FIELDS else jnp.int32,
                sharding=sharding,
            )
            for key in self.batch_fields
        }

    def lower_train_step(self, global_batch: int, seq_len: int) -> jax.stages.Lowered:
        """The train step for a batch shape, traced and lowered (jax.stages.Lowered: the program
        JAX hands XLA, before XLA optimizes it; nothing compiles or runs)."""
        batch = self.abstract_batch(global_batch, seq_len)
        return self.train_step.lower(
            self.abstract_params, self.abstract_opt_state, self.abstract_loss_scale, batch
        )

    def compile_train_step(self, global_batch: int, seq_len: int) -> jax.stages.Compiled:
        """Lower and compile the train step for a batch shape (AOT; nothing runs)."""
        return self.lower_train_step(global_batch, seq_len).compile()


def check_executor(executor: str) -> None:
    """UsageError unless `executor` is one of EXECUTORS."""
    if executor not in EXECUTORS:
        raise UsageError(f"--collectives {executor!r} is not an executor; use auto or explicit")


def check_batch(global_batch: int, layout: Layout, accum: int) -> None:
    """UsageError unless the global batch splits evenly into accum micro-batches per device."""
    if accum < 1:
        raise UsageError(f"--accum {accum} must be a positive number of micro-batches")
    ways = layout.data_parallel * accum
    if global_batch < 1 or global_batch % ways:
        raise UsageError(
            f"--batch {global_batch} is not divisible by data-parallel size "
            f"{layout.data_parallel} x accum {accum} = {ways}; use a multiple of {ways}"
        )


def _in_sequence_order(loss_fn: Callable) -> Callable:
    """`loss_fn(model or params, batch)` on the batch in the layout's sequence order (context
    parallelism's chunks)."""

    def loss(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return loss_fn(model, hooks.split_sequences(batch))

    return loss


def build_program(
    make_model: Callable[[int], nnx.Module],
    loss_fn: LossFn,
    tx: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    layout: Layout,
    options: StepOptions = DEFAULTS,
    **overrides: Any,
) -> Program:
    """Shardings and jitted steps for a model built by `make_model(options.seed)` (an NNX
    module whose params carry logical axis names), trained with `loss_fn(model, batch)` and `tx`
    (or `tx(names)`, given the logical names of every param, e.g. for a weight-decay mask).

    `options` (spmd.engine.options.StepOptions; `overrides` replace its fields by name, e.g.
    `accum=4`) says the rest: the policy sets the master-weight dtype, the gradient
    accumulation / reduction dtype and fp16 loss scaling, while the model's compute dtype is
    `make_model`'s to set (pass `policy.compute_dtype` to it); the executor "auto" lets XLA's
    partitioner insert the collectives, "explicit" runs the steps under shard_map with the
    hand-written collectives of spmd.engine.explicit, both taking and returning the same
    pytrees with the same shardings; with a pipeline and a `pipeline` mesh axis over 1 the loss
    and its gradients come from that schedule instead of `loss_fn`; offload_state keeps state
    in host memory between steps (spmd.engine.offload).

    This is the engine's part of the one road: the commands and `spmd.build` reach it through
    spmd.run.builder, which checks the batch and the layout first.

    Raises UsageError up front if a mesh axis does not divide a dimension it must split."""
    options = dataclasses.replace(options, **overrides) if overrides else options
    check_executor(options.executor)
    pipelined = options.pipelined(layout.mesh)
    vmapped = bool(options.exclude_axes)
    offload.check(options.offload_state, layout.zero_stage, pipelined, vmapped=vmapped)
    policy, executor = options.policy, options.executor
    graphdef, names, shapes = abstract_model(make_model, options.seed, layout, policy, executor)
    policy = fp8_setup.checked_policy(policy, names, shapes, layout, options, pipelined)
    options = dataclasses.replace(options, policy=policy)
    loss_fn = _in_sequence_order(loss_fn)
    if not isinstance(tx, optax.GradientTransformation):
        tx = tx(frozen.trainable(names))  # the optimizer sees the trainable params only
    shardings, opt_shapes = state_layout.state_shardings(tx, names, shapes, layout, policy)
    losses = fp8_setup.in_fp8(_losses(graphdef, names, loss_fn, layout, options), policy)
    executor_steps = explicit_steps if executor == "explicit" else auto_steps
    loss = losses.local_loss if executor == "explicit" else losses.global_loss
    in_step = dataclasses.replace(options, accum=losses.step_accum)
    train_step, eval_step = executor_steps(loss, tx, layout, shardings, in_step)
    placed = offload.placed(shardings, options.offload_state)
    abstract = state_layout.abstract_state(shapes, opt_shapes, placed, layout, policy)
    makers = _state_makers(make_model, options.seed, tx, policy)
    return Program(
        layout=layout,
        graphdef=graphdef,
        names=names,
        accum=options.accum,
        policy=policy,
        train_fn=train_step,
        makers=makers,
        prefetch=options.prefetch and executor == "explicit",
        batch_fields=options.batch_fields,
        eval_params=options.eval_params,
        **abstract,
        **_jitted(abstract, makers, train_step, eval_step, shardings["batch"], layout.replicated),
    )


class _Losses(NamedTuple):
    global_loss: Callable  # (params, batch) -> mean loss, for the auto executor's jit
    local_loss: Callable  # the explicit executor's per-device loss
    step_accum: int  # micro-batches the step itself loops over


def _losses(
    graphdef: Any, names: Any, loss_fn: Callable, layout: Layout, options: StepOptions
) -> _Losses:
    """The losses the executors differentiate: `loss_fn` on the merged model (the same
    function on each device's blocks), or with pp > 1 the pipeline schedule's (which
    accumulates the micro-batches itself)."""
    mesh, executor, accum, pipeline = layout.mesh, options.executor, options.accum, options.pipeline

    def loss_of(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, params), batch)

    pipelined = options.pipelined(mesh)  # accumulates inside
    if executor == "auto" and accum > 1 and mesh.shape["context"] > 1 and not pipelined:
        # the ring's shard_map cannot sit inside accumulation's vmap over the batch axes
        raise UsageError(f"--accum {accum} with cp > 1 needs --collectives explicit")
    if pipeline is None or not pipelined:
        return _Losses(loss_of, loss_of, accum)
    from spmd.parallel import pipeline as pp

    pp.check_composition(executor, options.policy, pipeline)
    # Accumulation happens inside the schedule: accum x M micro-batches in one pass.
    pipeline = pp.with_accumulation(pipeline, mesh.shape["pipeline"], accum)
    return _Losses(
        pp.pipelined_loss(graphdef, names, layout, pipeline),
        pp.manual_pipelined_loss(graphdef, names, pipeline, mesh.shape["pipeline"]),
        1,
    )


class _StateMakers(NamedTuple):
    init: Callable[[], TrainState]
    start: Callable[[Any], TrainState]
    from_checkpoint: Callable[[dict], TrainState]


def _state_makers(
    make_model: Callable[[int], nnx.Module],
    seed: int,
    tx: optax.GradientTransformation,
    policy: precision.Policy,
) -> _StateMakers:
    """The functions that make a TrainState: fresh, from master weights, from a checkpoint."""

    def start(master: Any) -> TrainState:
        master = precision.cast(master, policy.master_dtype)
        # the optimizer (and the master copy) holds the trainable params only
        opt_state = precision.init_opt_state(tx, frozen.trainable(master), policy)
        params = precision.cast(master, policy.param_dtype)
        return TrainState(params, opt_state, precision.init_loss_scale(policy))

    def init() -> TrainState:
        with nnx.use_eager_sharding(False):
            return start(nnx.to_pure_dict(nnx.state(make_model(seed))))

    def from_checkpoint(saved: dict) -> TrainState:
        master = frozen.trainable(saved["params"])
        opt_state = precision.join_opt_state(master, saved["opt_state"], policy)
        params = precision.cast(saved["params"], policy.param_dtype)
        loss_scale = precision.restored_loss_scale(saved["loss_scale"], policy)
        return TrainState(params, opt_state, loss_scale)

    return _StateMakers(init, start, from_checkpoint)


def _jitted(
    abstract: dict[str, Any],
    makers: _StateMakers,
    train_step: Callable,
    eval_step: Callable,
    batch_sharding: NamedSharding,
    replicated: NamedSharding,
) -> dict[str, jax.stages.Wrapped]:
    """The Program's jitted functions: the state comes back in the shardings of `abstract`
    (state_layout.abstract_state), and the train step donates the state buffers. State that
    `abstract` puts in host memory is streamed to the devices inside the steps."""
    state_sh = TrainState(
        *(
            jax.tree.map(lambda s: s.sharding, abstract[f"abstract_{role}"])
            for role in ("params", "opt_state", "loss_scale")
        )
    )
    train_step = offload.streamed_train_step(train_step, state_sh)
    eval_step = offload.streamed_eval_step(eval_step, state_sh.params)
    once = once_options(replicated.mesh)
    return {
        "init": jax.jit(makers.init, out_shardings=state_sh, compiler_options=once),
        "start": jax.jit(makers.start, out_shardings=state_sh, compiler_options=once),
        "from_checkpoint": jax.jit(
            makers.from_checkpoint, out_shardings=state_sh, compiler_options=once
        ),
        "train_step": jax.jit(
            train_step,
            in_shardings=(*state_sh, batch_sharding),
            out_shardings=(*state_sh, replicated),
            donate_argnums=(0, 1, 2),
        ),
        "eval_step": jax.jit(
            eval_step, in_shardings=(state_sh.params, batch_sharding), out_shardings=replicated
        ),
    }
