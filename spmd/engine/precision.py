"""Mixed-precision policies and dynamic loss scaling.

A policy names five dtypes, as the ZeRO paper lays out mixed precision: `param` (the working
params the model holds and the step all-gathers: the compute dtype, 16-bit under bf16 / fp16),
`master` (the weights the optimizer updates, kept with its moments in the optimizer state and
sharded with it from ZeRO-1 on: always fp32, since updates of lr * 1e-3 relative size vanish
in a 16-bit mantissa), `compute` (matmuls and activations), `reduce` (the gradients: their
accumulation over micro-batches and the cross-device reduction; `--grad-reduce`) and `output`
(the loss reported). Under fp32 the working params are the master weights (no copy).

fp16 has 5 exponent bits, so small gradients underflow to zero in its backward pass. The loss
is multiplied by a scale before differentiation and the gradients divided by it after; the
scale is dynamic: it halves (and that optimizer step is skipped) when a gradient is not finite,
and doubles after `growth_interval` finite steps in a row. bf16 has fp32's exponent range and
needs no scaling.

The scale lives in a small pytree of replicated scalars, part of the train state (so it can be
checkpointed): {"scale": f32, "good_steps": i32, "skipped_steps": i32}.

`fp8` is bf16 whose stacked blocks' matmuls run as fp8 dots (models/fp8.py; settings in
spmd.parallel.fp8_context.Fp8Settings). Under delayed scaling the same dict also holds
"fp8": the amax history (spmd.engine.fp8_state), checkpointed with the scale.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from spmd.engine import fp8_state
from spmd.errors import UsageError
from spmd.parallel import fp8_context
from spmd.parallel.fp8_context import Fp8Settings

if TYPE_CHECKING:
    from collections.abc import Callable

    from spmd.sections import PrecisionConfig

LossScale = dict[str, Any]  # scalars, and under delayed fp8 scaling "fp8": its history


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes of one precision policy and, for fp16, the loss-scale dynamics."""

    name: str
    param_dtype: Any  # working params: what the model holds and the step all-gathers
    compute_dtype: Any
    reduce_dtype: Any  # gradient accumulation and cross-device reduction
    output_dtype: Any
    loss_scaling: bool = False
    initial_scale: float = 2.0**15
    growth_interval: int = 2000  # finite steps in a row before the scale grows
    growth_factor: float = 2.0
    backoff_factor: float = 0.5  # on a non-finite gradient
    master_dtype: Any = jnp.float32  # the weights the optimizer updates
    fp8: Fp8Settings | None = None  # the blocks' matmuls in fp8 (--precision fp8)

    @property
    def delayed(self) -> bool:
        """True under fp8 with delayed scaling (an amax history in the train state)."""
        return self.fp8 is not None and self.fp8.recipe == "delayed"

    @property
    def has_master(self) -> bool:
        """True when the optimizer state keeps master weights apart from the working params."""
        return jnp.dtype(self.param_dtype) != jnp.dtype(self.master_dtype)

    def itemsize(self, role: str) -> int:
        """Bytes per element of the policy's "param", "master", "compute", "reduce" or "output"
        dtype (what the planner counts per parameter or activation)."""
        dtypes = {
            "param": self.param_dtype,
            "master": self.master_dtype,
            "compute": self.compute_dtype,
            "reduce": self.reduce_dtype,
            "output": self.output_dtype,
        }
        return jnp.dtype(dtypes[role]).itemsize


F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# The 16-bit policies reduce gradients in their compute dtype by default, as the ZeRO paper,
# DeepSpeed and PyTorch FSDP (reduce_dtype = param_dtype) do: half the bytes on the wire.
# `--grad-reduce fp32` is Megatron-LM's / torchtitan's choice (fp32 accumulation and reduce).
POLICIES = {
    "fp32": Policy("fp32", F32, F32, F32, F32),
    "bf16": Policy("bf16", BF16, BF16, BF16, F32),
    "fp16": Policy("fp16", F16, F16, F16, F32, loss_scaling=True),
    # bf16 whose blocks' matmuls are fp8 dots: e4m3 inputs and weights, e5m2 gradients
    # (e4m3 under rowwise scaling: fp8_context.GRAD_FORMAT)
    "fp8": Policy("fp8", BF16, BF16, BF16, F32, fp8=Fp8Settings()),
}
DTYPE_NAMES = {"fp32": F32, "bf16": BF16, "fp16": F16}


def get(name: str, grad_reduce: str = "", fp8: Fp8Settings | None = None) -> Policy:
    """The policy called `name`, reducing gradients in `grad_reduce` ("": the policy's
    default), with the fp8 `settings` when `name` is fp8 (None: the defaults); UsageError
    naming the valid values otherwise."""
    if name not in POLICIES:
        raise UsageError(f"--precision {name!r} is not one of {', '.join(POLICIES)}")
    policy = POLICIES[name]
    if policy.fp8 is not None and fp8 is not None:
        policy = dataclasses.replace(policy, fp8=check_fp8(fp8))
    if not grad_reduce:
        return policy
    allowed = sorted({"fp32", short_name(policy.compute_dtype)})
    if grad_reduce not in allowed:
        raise UsageError(
            f"--grad-reduce {grad_reduce!r} does not go with --precision {name}; use "
            f"{' or '.join(allowed)} (fp32, or the policy's 16-bit compute dtype)"
        )
    return dataclasses.replace(policy, reduce_dtype=DTYPE_NAMES[grad_reduce])


def from_section(section: PrecisionConfig) -> Policy:
    """The policy of a run's precision section (spmd.sections.PrecisionConfig)."""
    settings = Fp8Settings(
        recipe=section.fp8_recipe,
        min_dim=section.fp8_min_dim,
        all_gather=section.fp8_all_gather,
        history=section.fp8_history,
        emulate=section.fp8_emulate,
    )
    check_fp8(settings)
    if section.precision != "fp8":
        for flag, given in {
            "--fp8-all-gather": section.fp8_all_gather,
            "--fp8-emulate": section.fp8_emulate,
        }.items():
            if given:
                raise UsageError(f"{flag} needs --precision fp8, not {section.precision}")
    return get(section.precision, section.grad_reduce, settings)


def check_fp8(settings: Fp8Settings) -> Fp8Settings:
    """`settings` when valid, else UsageError naming the value and what would be valid."""
    if settings.recipe not in fp8_context.RECIPES:
        raise UsageError(
            f"--fp8-recipe {settings.recipe!r} is not one of {', '.join(fp8_context.RECIPES)}"
        )
    if settings.min_dim < 0:
        raise UsageError(f"--fp8-min-dim {settings.min_dim} must be >= 0 (0: every matmul)")
    if settings.history < 1:
        raise UsageError(f"--fp8-history {settings.history} must be a positive number of steps")
    return settings


def short_name(dtype: Any) -> str:
    """fp32, bf16 or fp16."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[jnp.dtype(dtype).name]


def describe(policy: Policy, block_matmuls: list[tuple[int, int]] | None = None) -> str:
    """One line for the run log, e.g. "precision bf16: params bf16 (master fp32 in the optimizer
    state), compute bf16, grad reduce bf16, output fp32". Under fp8, `block_matmuls` are the
    (k, n) of one stacked block's matmuls (spmd.engine.fp8_setup.block_matmuls): the line says
    how many of them the size rule puts in fp8, and when none, how to change that."""
    short = short_name
    master = f" (master {short(policy.master_dtype)} in the optimizer state)"

    scaling = (
        f", dynamic loss scale from {policy.initial_scale:g} (x{policy.growth_factor:g} after "
        f"{policy.growth_interval} finite steps, x{policy.backoff_factor:g} and skip on overflow)"
        if policy.loss_scaling
        else ""
    )
    fp8 = ""
    if policy.fp8 is not None:
        fp8 = "; " + _fp8_words(policy.fp8, block_matmuls or [], short(policy.compute_dtype))
    return (
        f"precision {policy.name}: params {short(policy.param_dtype)}"
        f"{master if policy.has_master else ''}, compute "
        f"{short(policy.compute_dtype)}, grad reduce {short(policy.reduce_dtype)}, output "
        f"{short(policy.output_dtype)}{scaling}{fp8}"
    )


def _fp8_words(s: Fp8Settings, matmuls: list[tuple[int, int]], compute: str) -> str:
    """What fp8 runs: the block matmuls per layer whose k and n reach --fp8-min-dim (the rule
    fp8_context.site applies), how, and when none does, the --fp8-min-dim that would."""
    total = len(matmuls)
    chosen = sum(fp8_context.reaches(s, k, n) for k, n in matmuls)
    rule = f"k and n >= {s.min_dim}"
    if not chosen:
        sizes = sorted({min(k, n) for k, n in matmuls}, reverse=True)
        if not sizes:
            return "fp8: the model has no stacked block matmuls, so nothing runs in fp8"
        largest = sizes[0]
        reached = sum(min(k, n) >= largest for k, n in matmuls)
        every = f", {sizes[-1]} all {total}" if len(sizes) > 1 else ""
        return (
            f"fp8: none of the {total} block matmuls per layer has {rule} (--fp8-min-dim), so "
            f"nothing runs in fp8 and the step computes in {compute}; --fp8-min-dim {largest} "
            f"would put {reached} of {total} in fp8{every}"
        )
    gather = ", ZeRO-3 gathers them in e4m3" if s.all_gather else ""
    history = f" ({s.history}-step amax history)" if s.recipe == "delayed" else ""
    others = f"the other {total - chosen}, " if chosen < total else ""
    return (
        f"fp8: {chosen} of {total} block matmuls per layer ({rule}; {others}the embeddings and "
        f"the LM head stay {compute}), e4m3 inputs and weights, "
        f"{fp8_context.GRAD_FORMAT[s.recipe]} gradients, {s.recipe} scaling{history}{gather}"
    )


def init_loss_scale(policy: Policy) -> LossScale:
    """The loss-scale state at step 0 (scale 1 when the policy does not scale; with the
    empty amax history under delayed fp8 scaling)."""
    state: LossScale = {
        "scale": jnp.asarray(policy.initial_scale if policy.loss_scaling else 1.0, jnp.float32),
        "good_steps": jnp.zeros((), jnp.int32),
        "skipped_steps": jnp.zeros((), jnp.int32),
    }
    if policy.delayed:
        assert policy.fp8 is not None
        state["fp8"] = fp8_state.init(policy.fp8)
    return state


def restored_loss_scale(saved: LossScale, policy: Policy) -> LossScale:
    """A checkpoint's loss-scale dict for this policy: with an empty amax history when the run
    scales delayed and the checkpoint has none (it was saved under another precision or
    recipe), without the checkpoint's history when the run does not scale delayed."""
    state = dict(saved)
    if policy.delayed and "fp8" not in state:
        assert policy.fp8 is not None
        state["fp8"] = fp8_state.init(policy.fp8)
    elif not policy.delayed:
        state.pop("fp8", None)
    return state


def all_finite(tree: Any) -> jax.Array:
    """True (a bool scalar) when every element of every leaf is finite."""
    return jnp.stack([jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)]).all()


def unscale(grads: Any, state: LossScale, policy: Policy) -> Any:
    """Gradients of the scaled loss divided by the scale (unchanged when not scaling)."""
    if not policy.loss_scaling:
        return grads
    inverse = 1.0 / state["scale"]
    return jax.tree.map(lambda g: g * inverse.astype(g.dtype), grads)


def next_loss_scale(state: LossScale, finite: jax.Array, policy: Policy) -> LossScale:
    """The state after a step whose gradients were `finite` or not: back off and count a skip
    on overflow; grow after `growth_interval` finite steps in a row."""
    if not policy.loss_scaling:
        return state
    good = jnp.where(finite, state["good_steps"] + 1, 0)
    grow = good >= policy.growth_interval
    scale = jnp.where(
        finite,
        jnp.where(grow, state["scale"] * policy.growth_factor, state["scale"]),
        jnp.maximum(state["scale"] * policy.backoff_factor, jnp.finfo(jnp.float32).tiny),
    )
    return {
        "scale": scale,
        "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
        "skipped_steps": state["skipped_steps"] + (~finite).astype(jnp.int32),
    }


def keep_if_finite(finite: jax.Array, updated: Any, current: Any) -> Any:
    """`updated` when `finite`, else `current`, leaf by leaf: a skipped step changes nothing."""
    return jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, current)


def scaled_value_and_grad(
    loss_of: Callable[[Any, Any], jax.Array], state: LossScale, policy: Policy
) -> Callable[[Any, Any], tuple[jax.Array, Any]]:
    """`(params, batch) -> (loss, grads of loss * scale)`: jax.value_and_grad of `loss_of`, the
    loss multiplied by the current scale first when the policy scales (the loss returned is
    unscaled). Under delayed fp8 scaling the matmuls scale by the history in `state` and
    the amaxes they saw are left in `state[fp8_state.SEEN]` (a step that calls this once,
    not inside a scan or vmap: delayed scaling refuses accumulation and pipelines), which
    `fp8_state.fold` pushes into the history when the step updates the state."""
    if policy.delayed:
        return _delayed_value_and_grad(loss_of, state, policy)
    if not policy.loss_scaling:
        return jax.value_and_grad(loss_of)

    def scaled(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
        loss = loss_of(params, batch)
        return loss * state["scale"], loss

    def loss_and_grads(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params, batch)
        return loss, grads

    return loss_and_grads


def _delayed_value_and_grad(
    loss_of: Callable[[Any, Any], jax.Array], state: LossScale, policy: Policy
) -> Callable[[Any, Any], tuple[jax.Array, Any]]:
    """scaled_value_and_grad under delayed fp8 scaling (no loss scaling: bf16 compute)."""

    def loss_and_grads(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        scales, probe = fp8_state.scales(state["fp8"]), fp8_state.probe(state["fp8"])

        def loss_with(params: Any, probe: Any) -> jax.Array:
            with fp8_context.use(policy.fp8, scales, probe):
                return loss_of(params, batch)

        loss, (grads, seen) = jax.value_and_grad(loss_with, argnums=(0, 1))(params, probe)
        state[fp8_state.SEEN] = seen
        return loss, grads

    return loss_and_grads


# --- master weights ---------------------------------------------------------------------------
# Under bf16 / fp16 the optimizer state is {"master": fp32 params, "inner": the optimizer's own
# state}, both laid out by the opt_state rules (sharded over fsdp from ZeRO-1 on); under fp32 it
# is the optimizer's state alone and the params are the master weights.


def cast(tree: Any, dtype: Any) -> Any:
    """Every floating leaf of `tree` as `dtype` (no-op for leaves already of it). Integer
    leaves keep theirs: a QLoRA base's 4-bit codes and scale bits (models/nf4.py)."""
    return jax.tree.map(lambda x: x.astype(dtype) if _recast(x, dtype) else x, tree)


def _recast(x: Any, dtype: Any) -> bool:
    return x.dtype != dtype and jnp.issubdtype(x.dtype, jnp.floating)


def working_dtype(dtype: Any, policy: Policy) -> Any:
    """The dtype a param created as `dtype` is held in: the policy's param dtype if it is a
    floating one, else its own (`cast`)."""
    return policy.param_dtype if jnp.issubdtype(dtype, jnp.floating) else dtype


def init_opt_state(tx: optax.GradientTransformation, master: Any, policy: Policy) -> Any:
    """The optimizer state at step 0 for master weights `master` (fp32)."""
    if not policy.has_master:
        return tx.init(master)
    return {"master": master, "inner": tx.init(master)}


def split_opt_state(params: Any, opt_state: Any, policy: Policy) -> tuple[Any, Any]:
    """(master weights, the optimizer's own state) of a train state."""
    if not policy.has_master:
        return params, opt_state
    return opt_state["master"], opt_state["inner"]


def join_opt_state(master: Any, inner: Any, policy: Policy) -> Any:
    return {"master": master, "inner": inner} if policy.has_master else inner


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: Any,
    params: Any,
    opt_state: Any,
    state: LossScale,
    policy: Policy,
) -> tuple[Any, Any, LossScale, Any]:
    """One optimizer update from (reduced) gradients of the scaled loss: unscale in the master
    dtype, update the master weights, write back the working params in `policy.param_dtype`;
    when the policy scales, skip the update (everything returned as it was) if any gradient
    is not finite. Returns (params, opt_state, loss-scale state, unscaled master-dtype grads).
    The gradients must be the global ones, so every device takes the same decision."""
    state = fp8_state.fold(state)
    grads = unscale(cast(grads, policy.master_dtype), state, policy)
    master, inner = split_opt_state(params, opt_state, policy)
    updates, new_inner = tx.update(grads, inner, master)
    new_master = optax.apply_updates(master, updates)
    if policy.loss_scaling:
        finite = all_finite(grads)
        new_master, new_inner = keep_if_finite(finite, (new_master, new_inner), (master, inner))
        state = next_loss_scale(state, finite, policy)
    new_params = cast(new_master, policy.param_dtype)
    return new_params, join_opt_state(new_master, new_inner, policy), state, grads
