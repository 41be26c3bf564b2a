"""The library API with a user's own NNX model (not the Llama): every layout and both
executors give the one-device losses; a model that names no axes still runs data-parallel."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmd
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
