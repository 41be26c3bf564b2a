"""--precision fp8 (docs/strategies/fp8.md): the blocks' matmuls lower to fp8 dots, sharded
fp8 trains like one device under both executors, ZeRO-3 gathers in e4m3 at half the bytes,
and delayed scaling's amax history resumes bitwise. Emulated on CPU (XLA:CPU's fp8 types).
Bad flags are in test_bad_inputs.py's table."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import fp8
from spmd.engine import fp8_setup, fp8_state, precision
from spmd.engine.options import StepOptions
from spmd.engine.step import ONCE_ON_CPU
from spmd.estimate import comms, cost, flops, measure, theory, timing
from spmd.estimate.shape import release_for
from spmd.io import checkpoint, checkpoint_restore, state_check
from spmd.model_shape import ModelShape
from spmd.parallel import fp8_context
from spmd.parallel.fp8_context import Fp8Settings, Site
from spmd.run import builder
from spmd.run.config import flat
from tests import trainer

STEPS = 3


def program(mesh: str, policy: precision.Policy, executor: str = "auto", zero: int = 3):
    train = flat(None, steps=STEPS, batch=trainer.BATCH, seq_len=trainer.SEQ_LEN, warmup=2)
    spec = builder.model_spec(trainer.tiny_config(), policy)
    options = StepOptions(executor=executor, policy=policy)
    lay = trainer.layout(mesh, zero)
    return builder.build(spec, builder.optimizer(train), lay, options, None, trainer.BATCH, 32)


def fp8_policy(recipe: str = "tensorwise", all_gather: bool = False) -> precision.Policy:
    # the tiny model's dims (64, 256) are below the default size rule: every matmul in fp8
    return precision.get("fp8", "", Fp8Settings(recipe=recipe, min_dim=0, all_gather=all_gather))


def test_fp8_matmul_is_close_to_the_exact_one_with_its_gradients_for_every_recipe() -> None:
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (32, 64)) * jnp.linspace(0.1, 10, 64)  # uneven channels
    w = jax.random.normal(keys[1], (64, 48)) / 8
    c = jax.random.normal(keys[2], (32, 48))  # the output's cotangent

    @jax.jit
    def outputs(x, w, scales, probe):
        def run(site: Site) -> tuple:
            y, vjp = jax.vjp(
                lambda x, w, p: fp8.matmul(x, w, Site(site.recipe, scales, p)), x, w, probe
            )
            return y, *vjp(c)

        exact = jax.vjp(lambda x, w: x @ w, x, w)
        return (exact[0], *exact[1](c)), [run(Site(r)) for r in fp8_recipes()]

    # a history a little above this step's amaxes; the gradient's 0: none yet, current scaling
    scales = jnp.asarray([1.2 * jnp.abs(x).max() / 448, 1.2 * jnp.abs(w).max() / 448, 0.0])
    want, got = outputs(x, w, scales, jnp.zeros(3))
    for recipe, (y, gx, gw, seen) in zip(fp8_recipes(), got, strict=True):
        for a, b in ((y, want[0]), (gx, want[1]), (gw, want[2])):
            error = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert 1e-4 < error < 0.08, (recipe, error)  # quantized, yet close
        if recipe == "delayed":  # the probe's cotangent: the amaxes seen
            amaxes = [jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(c).max()]
            np.testing.assert_allclose(seen, amaxes, rtol=1e-6)


def fp8_recipes() -> tuple[str, ...]:
    return ("tensorwise", "rowwise", "delayed")


def test_the_gradient_is_e4m3_under_rowwise_scaling_and_e5m2_under_per_tensor_scaling() -> None:
    for recipe, formats in (
        ("tensorwise", {"f8E4M3FN", "f8E5M2"}),
        ("rowwise", {"f8E4M3FN"}),
        ("delayed", {"f8E4M3FN", "f8E5M2"}),
    ):
        site = Site(recipe, jnp.zeros(3), jnp.zeros(3))
        grads = jax.grad(lambda x, w, s=site: fp8.matmul(x, w, s).sum(), argnums=(0, 1))
        text = jax.jit(grads).lower(jnp.ones((8, 16)), jnp.ones((16, 8))).as_text()
        assert {f for f in ("f8E4M3FN", "f8E5M2") if f in text} == formats, recipe


def gathers(policy: precision.Policy) -> tuple[dict, float]:
    """(the lowered step's all-gathers: bytes, by dtype; the theory's all-gather bytes) of
    the tiny model on fsdp=4, ZeRO-3, explicit executor."""
    prog = program("fsdp=4", policy, "explicit")
    lowered = measure.lowered_gathers(prog, trainer.BATCH, 32, prog.layout.mesh)
    shape = trainer.tiny_config().shape()
    return lowered, theory.collectives(prog, shape, trainer.BATCH, 32)["all-gather"]["bytes"]


def test_fp8_all_gather_moves_half_the_bytes_of_bf16_under_zero3_as_theory_says() -> None:
    bf16, bf16_theory = gathers(precision.POLICIES["bf16"])
    fp8_gathers, fp8_theory = gathers(fp8_policy(all_gather=True))
    assert "f8e4m3fn" in fp8_gathers["by_dtype"] and "f8e4m3fn" not in bf16["by_dtype"]
    # the blocks' matrices in e4m3 (+ 4 bytes of scale per device); embedding and norms bf16
    ratio = fp8_gathers["bytes"] / bf16["bytes"]
    assert 0.50 <= ratio <= 0.55, f"{ratio:.3f} of bf16"
    assert fp8_gathers["bytes"] == fp8_theory and bf16["bytes"] == bf16_theory


@functools.cache
def delayed() -> tuple:
    """(the tiny delayed-fp8 program on one device, its lowered train step, compiled)."""
    prog = program("dp=1", fp8_policy("delayed"))
    lowered = prog.lower_train_step(trainer.BATCH, 32)
    return prog, lowered, quickly_compiled(lowered)


def test_delayed_fp8_lowers_to_fp8_dots_resumes_bitwise_and_trains_alike_when_sharded() -> None:
    prog, lowered, train = delayed()
    text = lowered.as_text()
    # the 7 block matmuls: e4m3 x e4m3 forward, e5m2 gradients in both backward products
    assert text.count("xf8E4M3FN>, tensor<") >= 7 and "f8E5M2" in text
    initial = jax.device_get(tuple(prog.init()))  # the sharded programs start from it too
    state, first = steps(prog, train, initial, range(2))
    saved = jax.device_get(prog.checkpoint_view(state))
    history = saved["loss_scale"]["fp8"]["amax_history"]  # newest first, 2 steps filled
    assert history[..., 0].max() > 0 and history[..., 1].max() > 0 and history[..., 2].max() == 0
    assert not np.array_equal(history[..., 0], history[..., 1])
    straight = steps(prog, train, state, range(2, 4))
    resumed = steps(prog, train, prog.makers.from_checkpoint(saved), range(2, 4))  # a restore
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    one = np.concatenate([first, straight[1]])
    assert np.all(np.isfinite(one)) and one[-1] < one[0]
    for executor in ("auto", "explicit"):  # the amaxes are global: one history on every device
        sharded = program("dp=2,fsdp=2,tp=2", fp8_policy("delayed"), executor)
        train = quickly_compiled(sharded.lower_train_step(trainer.BATCH, 32))
        losses = steps(sharded, train, placed(sharded, initial), range(4))[1]
        assert trainer.max_relative_difference(losses, one) < 1e-2, executor


def test_a_precision_change_on_resume_starts_or_drops_the_amax_history(tmp_path) -> None:
    prog, _, train = delayed()
    state, _ = steps(prog, train, jax.device_get(tuple(prog.init())), range(2))
    view = jax.device_get(prog.checkpoint_view(state))
    # what a bf16 or tensorwise run saves: the same entries without the history
    scalars = {k: v for k, v in view["loss_scale"].items() if k != "fp8"}
    without = {**view, "loss_scale": scalars}
    bf16 = program("dp=1", precision.POLICIES["bf16"])
    got = {}
    for saved, into, line in ((without, prog, "starts empty"), (view, bf16, "dropped it")):
        restored, lines = saved_and_restored(saved, into, tmp_path / line)
        # the saved norms checked all that was read (a mismatch: set aside as damaged)
        assert restored.step == 2 and len(lines) == 1 and line in lines[0], lines
        # params, optimizer state and loss scale as saved; the history fresh or gone
        for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(without), strict=True):
            np.testing.assert_array_equal(a, b)
        got[line] = into.from_checkpoint(restored.state)
    resumed = got["starts empty"]
    assert not np.any(jax.device_get(resumed.loss_scale["fp8"]["amax_history"]))
    # its first step scales as a fresh delayed run's from the same params, not as the run
    # that kept its history
    fresh = steps(prog, train, prog.start(without["params"]), [2])[1]
    assert steps(prog, train, resumed, [2])[1] == fresh != steps(prog, train, state, [2])[1]
    back = got["dropped it"]
    targets = (bf16.abstract_params, bf16.abstract_opt_state, bf16.abstract_loss_scale)
    assert jax.tree.structure(tuple(back)) == jax.tree.structure(targets)


def saved_and_restored(saved: dict, into, folder) -> tuple:
    """(`saved` written as a checkpoint of step 2 with its norms, then restored into program
    `into` as a resume does; the lines said)."""
    lines: list[str] = []
    manager = checkpoint.open_manager(str(folder), 2)
    checkpoint.save(manager, 2, saved, {state_check.NORMS: state_check.state_norms(saved)}, {})
    target = into.abstract_checkpoint()
    optional = fp8_state.CHECKPOINT_OPTIONAL
    restored = checkpoint_restore.restore_newest(manager, target, {}, lines.append, False, optional)
    manager.close()
    return restored, lines


def quickly_compiled(lowered):
    """The lowered step compiled without XLA:CPU's LLVM optimizations (as the engine compiles
    its run-once programs): a fraction of the compile time for a few steps."""
    return lowered.compile(compiler_options=ONCE_ON_CPU)


def placed(prog, state: tuple) -> tuple:
    """Host `state` (params, opt_state, loss_scale) on `prog`'s shardings."""
    targets = (prog.abstract_params, prog.abstract_opt_state, prog.abstract_loss_scale)
    return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), tuple(state), targets)


def steps(prog, train, state, numbers) -> tuple:
    """(state, losses) after `train` (a compiled step) on the batches of `numbers`."""
    state = placed(prog, state)
    losses = []
    for step in numbers:
        *state, metrics = train(*state, batch(step, prog))
        losses.append(metrics["loss"])
    return state, np.asarray(jax.device_get(losses))


def batch(step: int, prog) -> dict:
    win = trainer.windows()
    ids = trainer.data.train_window_ids(0, step, trainer.BATCH, win.n_train)
    return trainer.data.global_batch(win, ids, prog.layout.batch_sharding())


def test_the_planner_runs_the_block_matmuls_at_twice_the_rate_and_mfu_stays_against_bf16() -> None:
    mesh = {"data": 1, "pipeline": 1, "fsdp": 8, "tensor": 1}
    bf16 = cost.Setup(
        ModelShape(**release_for(1e9).fields()), 1e9, mesh, 3, "bf16", "adamw", 8, 2048
    )
    fp8 = dataclasses.replace(bf16, precision="fp8")
    net = cost.Network(400e9, 50e9, 0.0, 8)
    saved = (
        timing.step_time(bf16, net, 400e12)["compute"]
        - timing.step_time(fp8, net, 400e12)["compute"]
    )
    blocks = 3 * bf16.batch * bf16.seq_len * timing.forward_flops_per_token(bf16)["blocks"]
    assert saved == pytest.approx(blocks / 2 / 8 / 400e12)
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == flops.peak_tflops(
        "NVIDIA H100 80GB HBM3", "bf16"
    )
    # --fp8-all-gather: ZeRO-3's block gathers in 1 byte a param, the rest in bf16's 2
    gathers = {c.purpose: c.bytes for c in comms.collectives(bf16) if c.kind == "all-gather"}
    halved = dataclasses.replace(fp8, fp8_all_gather=True)
    fp8_gathers = {c.purpose: c.bytes for c in comms.collectives(halved) if c.kind == "all-gather"}
    assert fp8_gathers["block params"] == gathers["block params"] / 2
    assert fp8_gathers["embed, head"] == gathers["embed, head"]


def _fp8_dots(jaxpr) -> int:
    """dot_generals with e4m3 operands in a jaxpr and the jaxprs inside it (a scan's body once)."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            count += eqn.invars[0].aval.dtype == jnp.float8_e4m3fn
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    count += _fp8_dots(inner)
    return count


@pytest.mark.parametrize("min_dim, said", [
    (512, "none of the 7 block matmuls per layer has k and n >= 512 (--fp8-min-dim), so nothing "
          "runs in fp8 and the step computes in bf16; --fp8-min-dim 64 would put 5 of 7 in fp8, "
          "32 all 7"),
    (64, "fp8: 5 of 7 block matmuls per layer (k and n >= 64; the other 2, the embeddings"),
    (32, "fp8: 7 of 7 block matmuls per layer (k and n >= 32; the embeddings"),
])  # fmt: skip
def test_the_start_up_line_counts_the_block_matmuls_fp8_runs(min_dim: int, said: str) -> None:
    # the tiny preset (64 wide): at the default --fp8-min-dim 512 fp8 changes nothing, and the
    # line says so; the count is the fp8 dots one layer of the traced loss holds
    settings = Fp8Settings(min_dim=min_dim)
    policy = precision.get("fp8", "", settings)
    spec = builder.model_spec(trainer.tiny_config(), policy)
    matmuls = fp8_setup.block_matmuls(spec.make, spec.loss, settings)
    line = precision.describe(policy, matmuls)
    assert said in line and "with k and n >=" not in line, line
    # the device line speaks of fp8's rate only where some matmul runs in fp8
    device = fp8_setup.device_line(trainer.layout("dp=1").mesh, settings, matmuls)
    assert (device is None) == (min_dim == 512), device

    def loss():
        tokens = jnp.zeros((1, 8), jnp.int32)
        return spec.loss(spec.make(0), {"inputs": tokens, "targets": tokens})

    with fp8_context.use(settings):
        dots = _fp8_dots(jax.make_jaxpr(loss)().jaxpr)
    assert dots == {512: 0, 64: 5, 32: 7}[min_dim]
