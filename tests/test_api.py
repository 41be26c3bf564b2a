"""The library API with a user's own NNX model (not the Llama): every layout and both
executors give the one-device losses; a model that names no axes still runs data-parallel."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmd
from spmd.engine.diloco import Sync
from spmd.errors import UsageError

STEPS, BATCH, FEATURES = 5, 16, 8


class NamedRegressor(nnx.Module):
    """A residual MLP regressor whose params name logical axes and read through the hooks."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)
        self.w_in = nnx.Param(init(rngs.params(), (FEATURES, 32)), out_sharding=("embed", "mlp"))
        self.w_out = nnx.Param(init(rngs.params(), (32, FEATURES)), out_sharding=("mlp", "embed"))
        self.readout = nnx.Param(init(rngs.params(), (FEATURES, 1)), out_sharding=("embed", None))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.tanh(spmd.tp_enter(x, "mlp") @ spmd.gather(self.w_in))
        x = x + spmd.tp_reduce(h @ spmd.gather(self.w_out), "mlp")
        return (x @ spmd.gather(self.readout))[:, 0]


class PlainRegressor(nnx.Module):
    """The same shape of model written with no logical names at all."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)
        self.w_in = nnx.Param(init(rngs.params(), (FEATURES, 32)))
        self.bias = nnx.Param(jnp.zeros((3,)))  # 3 is not divisible by fsdp=4: replicated
        self.readout = nnx.Param(init(rngs.params(), (32, 1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (jnp.tanh(x @ self.w_in[...]) @ self.readout[...])[:, 0] + self.bias[...].sum()


def mse(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def losses(model_cls, mesh_spec: str, zero: int = 3, executor: str = "auto") -> np.ndarray:
    count = int(np.prod([int(part.split("=")[1]) for part in mesh_spec.split(",")]))
    mesh = spmd.make_mesh(mesh_spec, jax.devices()[:count])
    program = spmd.build(
        lambda seed: model_cls(nnx.Rngs(seed)), mse, optax.adam(3e-2), mesh,
        zero_stage=zero, executor=executor,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    state, out = program.init(), []
    for _ in range(STEPS):
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        host = {"x": x, "y": np.sin(x).sum(axis=1).astype(np.float32)}
        state, metrics = program.step(state, spmd.put_batch(host, program))
        out.append(float(metrics["loss"]))
    return np.array(out)


LAYOUTS = [("dp=4", 3), ("fsdp=4", 1), ("fsdp=4", 2), ("fsdp=4", 3), ("dp=2,tp=2", 3),
           ("fsdp=2,tp=2", 3)]  # fmt: skip


@pytest.mark.parametrize("executor", ["auto", "explicit"])
@pytest.mark.parametrize("mesh_spec,zero", LAYOUTS)
def test_user_model_with_names_matches_one_device(mesh_spec, zero, executor):
    reference = losses(NamedRegressor, "dp=1")
    assert reference[-1] < reference[0]  # it learns
    got = losses(NamedRegressor, mesh_spec, zero, executor)
    np.testing.assert_allclose(got, reference, rtol=1e-4)


@pytest.mark.parametrize("zero", [1, 3])
def test_model_without_names_runs_fsdp_and_says_what_it_split(zero, capsys):
    reference = losses(PlainRegressor, "dp=1")
    np.testing.assert_allclose(losses(PlainRegressor, "fsdp=4", zero), reference, rtol=1e-4)
    notice = capsys.readouterr().out
    assert "names no logical axes: fsdp=4 splits the largest divisible dimension" in notice
    assert "of 2 of 3 params (288 of 291 scalars" in notice  # w_in's 32, readout's 32
    program = spmd.build(
        lambda seed: PlainRegressor(nnx.Rngs(seed)), mse, optax.adam(1e-2),
        spmd.make_mesh("fsdp=4", jax.devices()[:4]), zero_stage=3,
    )  # fmt: skip
    specs = jax.tree.map(lambda a: a.sharding.spec, program.abstract_params)
    assert specs["w_in"] == jax.sharding.PartitionSpec(None, "fsdp")
    assert specs["readout"] == jax.sharding.PartitionSpec("fsdp", None)
    assert specs["bias"] == jax.sharding.PartitionSpec(None)


def test_model_without_names_cannot_use_tensor_or_explicit_zero3():
    with pytest.raises(UsageError, match="names no logical axes.*not tensor=2"):
        losses(PlainRegressor, "dp=2,tp=2")
    with pytest.raises(UsageError, match="explicit with ZeRO-3 needs a model"):
        losses(PlainRegressor, "fsdp=4", 3, "explicit")


def test_rules_and_mesh_from_strings():
    rules = spmd.sharding_rules(2)
    assert rules["grads"]["embed"] == ("fsdp",) and rules["params"]["embed"] == ()
    assert rules["params"]["mlp"] == ("tensor",)
    mesh = spmd.make_mesh("dp=2,tp=-1")
    want = {"data": 2, "pipeline": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4}
    assert dict(mesh.shape) == want
    with pytest.raises(UsageError, match="needs 16 devices and has 8"):
        spmd.make_mesh("dp=16")


def build_regressor(mesh_spec: str, tx=None, **kwargs):
    count = int(np.prod([int(part.split("=")[1]) for part in mesh_spec.split(",")]))
    mesh = spmd.make_mesh(mesh_spec, jax.devices()[:count])
    make = lambda seed: NamedRegressor(nnx.Rngs(seed))  # noqa: E731
    return spmd.build(make, mse, tx or optax.adam(3e-2), mesh, **kwargs)


def test_diloco_through_the_library_with_one_step_rounds_is_synchronous_training():
    """H = 1, outer lr 1, no momentum, SGD inside: the replicas' mean update is the update of
    their mean gradient, so the losses are synchronous data parallelism's."""
    tx = optax.sgd(0.1)
    sync = build_regressor("dp=2", tx)
    rounds = build_regressor("dp=2", tx, diloco=Sync(1, 1.0, 0.0))
    assert rounds.replicas == 2
    x = np.random.default_rng(0).normal(size=(BATCH, FEATURES)).astype(np.float32)
    host = {"x": x, "y": np.sin(x).sum(axis=1).astype(np.float32)}  # one batch, fitted
    sync_state, rounds_state, got, want = sync.init(), rounds.init(), [], []
    for step in range(1, STEPS + 1):
        sync_state, metrics = sync.step(sync_state, spmd.put_batch(host, sync))
        want.append(float(metrics["loss"]))
        rounds_state, metrics = rounds.step(rounds_state, spmd.put_batch(host, rounds), step)
        got.append(float(metrics["loss"]))
    assert want[-1] < want[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_offload_through_the_library_places_the_optimizer_state_on_the_host():
    program = build_regressor("fsdp=4", offload="optimizer")
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(program.abstract_opt_state)}
    params = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(program.abstract_params)}
    assert kinds == {"pinned_host"} and "pinned_host" not in params


def refuse(model_layout: UsageError | None = None):
    def check_layout(mesh, executor):
        if model_layout is not None:
            raise model_layout

    return check_layout


@pytest.mark.parametrize(
    "mesh_spec,kwargs,message",
    [
        ("dp=4", {"batch": 6}, "--batch 6 is not divisible by data-parallel size 4"),
        ("dp=2", {"batch": 8, "accum": 3}, "x accum 3 = 6"),
        ("dp=2,cp=2", {"seq_len": 30}, "30"),
        ("fsdp=4", {"diloco": Sync()}, "dp=1"),
        ("dp=2", {"diloco": Sync(), "executor": "explicit"}, "--collectives explicit"),
        ("dp=2", {"diloco": Sync(), "offload": "optimizer"}, "--dcn-sync diloco"),
        ("fsdp=4", {"offload": "params", "zero_stage": 1}, "needs --zero 3"),
        ("dp=2", {"offload": "disk"}, "--offload 'disk' is not one of"),
        ("dp=2", {"check_layout": refuse(UsageError("the model says no"))}, "says no"),
    ],
)
def test_library_refuses_what_the_commands_refuse_before_compiling(mesh_spec, kwargs, message):
    with pytest.raises(UsageError, match=message):
        build_regressor(mesh_spec, **kwargs)
