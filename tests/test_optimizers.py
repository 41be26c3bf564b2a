"""The optimizer and objective slots: every registered optimizer's state, as the engine
allocates it for the tiny model, is the state the planner counts from the same registry entry;
SGD's and momentum's updates are optax's on the schedule with masked weight decay; a new entry
reaches --optimizer, the planner and the engine with no other edit; unknown names exit 2
listing the valid ones."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import family
from spmd import plan
from spmd.engine import objectives, optimizers, precision
from spmd.engine.optim import Optimizer
from spmd.errors import UsageError
from spmd.estimate import cost, memory
from spmd.run import builder
from spmd.run.config import flat
from spmd.sections import OptimizerConfig
from tests import trainer
from tests.cli import train_in_process

# a real optimizer (signum: the sign of a gradient momentum) registered as a new entry would
# be (one line in the registry)
SIGNUM = Optimizer(
    name="signum",
    make=lambda cfg, lr, names: optax.chain(
        optax.trace(cfg.beta1), optax.scale_by_sign(), optax.scale_by_learning_rate(lr)
    ),
    state_slots=1,
)


def allocated_bytes_per_param(name: str, policy: str) -> float:
    """Bytes per param of the optimizer state (master copy included) of the tiny model's
    Program built by spmd.run.builder for optimizer `name`, from its abstract state (no
    allocation); optax's scalar step counts left out."""
    cfg = flat(trainer.tiny_config(), optimizer=name, precision=policy, batch=8, seq_len=32)
    program = builder.program(cfg, trainer.layout("dp=1").mesh)
    leaves = jax.tree.leaves(program.abstract_opt_state)
    held = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves if leaf.ndim > 0)
    return held / trainer.tiny_config().n_params()


def planned_bytes_per_param(name: str, policy: str) -> int:
    model = trainer.tiny_config()
    mesh = {"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 1}
    s = cost.Setup(model.shape(), model.n_params(), mesh, 1, policy, name, 8, 32)
    return memory.bytes_per_param(s)["optimizer"]


@pytest.mark.parametrize("name", [*optimizers.OPTIMIZERS, "signum"])
def test_planner_counts_the_state_the_engine_allocates(name, monkeypatch):
    monkeypatch.setitem(optimizers.OPTIMIZERS, "signum", SIGNUM)
    entry = optimizers.get(name)
    # Muon's split is the planner's mean over its param kinds; its 3 Newton-Schulz
    # coefficients (12 B per run, not per param) are all that the planner leaves out
    rel = 0 if entry.matrix_state_slots is None else 12 / trainer.tiny_config().n_params()
    # Adafactor's size-1 placeholders, which the planner leaves out: at most 2 fp32 values per
    # array slice (the tiny model has 4 layers x 9 block arrays + embedding, head, final norm: 39)
    slack = 0 if entry.state_values is None else 2 * 4 * 40 / trainer.tiny_config().n_params()
    for policy in ("fp32", "bf16"):  # bf16 adds the fp32 master copy
        allocated = allocated_bytes_per_param(name, policy)
        planned = planned_bytes_per_param(name, policy)
        assert allocated == pytest.approx(planned, rel=rel, abs=slack), (name, policy)
    if entry.matrix_state_slots is None:  # (Adafactor: nothing of the tiny model is factored)
        assert allocated == pytest.approx(4 + 4 * entry.state_slots, rel=0, abs=slack)
    else:  # between the matrices' figure and the rest's
        assert 4 + 4 * entry.matrix_state_slots < allocated < 4 + 4 * entry.state_slots


def test_sgd_and_momentum_are_optax_sgd_with_masked_weight_decay():
    names = {"w": ("embed", "mlp"), "b": ("embed",)}
    params = {"w": jnp.full((2, 3), 2.0), "b": jnp.full((2,), 2.0)}
    grads = [{"w": jnp.full((2, 3), 1.0), "b": jnp.full((2,), 1.0)}, {"w": jnp.ones((2, 3)) * 3}]
    grads[1]["b"] = jnp.full((2,), 3.0)
    cfg = OptimizerConfig(lr=0.5, warmup=0, lr_schedule="constant", grad_clip=0.0)
    for name, momentum in (("sgd", 0.0), ("momentum", cfg.beta1)):
        tx = optimizers.make_optimizer(dataclasses.replace(cfg, optimizer=name), 10, 32, names)
        state, trace = tx.init(params), {"w": 0.0, "b": 0.0}
        for g in grads:
            updates, state = tx.update(g, state, params)
            for key in ("w", "b"):  # weight decay on the matrix only
                decayed = g[key] + (cfg.weight_decay * params[key] if key == "w" else 0.0)
                trace[key] = decayed + momentum * trace[key]
                np.testing.assert_allclose(updates[key], -0.5 * trace[key], rtol=1e-6)


def test_a_registered_optimizer_reaches_the_planner_with_no_other_edit(monkeypatch, capsys):
    monkeypatch.setitem(optimizers.OPTIMIZERS, "signum", SIGNUM)
    assert plan.main(["--model", "tiny", "--optimizer", "signum", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer"] == "signum"
    # 2 (bf16 params) + 2 (grads) + 4 (fp32 master) + 4 (one fp32 moment)
    assert out["bytes_per_param"] == {"params": 2, "grads": 2, "optimizer": 8}


@pytest.mark.parametrize(
    ("flag", "valid"),
    [
        ("--optimizer", ", ".join(optimizers.OPTIMIZERS)),
        ("--objective", ", ".join(objectives.OBJECTIVES)),
    ],
)
def test_unknown_names_exit_2_listing_the_registry(flag, valid, tmp_path):
    done = train_in_process("--model", "tiny", flag, "bogus", "--run-dir", "none")
    assert done.returncode == 2
    assert f"{flag} 'bogus' is not one of {valid}" in done.stderr
    section, field = ("optimizer", "optimizer") if flag == "--optimizer" else ("run", "objective")
    toml = tmp_path / "run.toml"
    toml.write_text(f'[{section}]\n{field} = "bogus"\n')
    done = train_in_process("--model", "tiny", "--config", str(toml), "--run-dir", "none")
    assert done.returncode == 2 and f"is not one of {valid}" in done.stderr


def test_the_builder_takes_the_loss_of_the_registered_objective():
    fp32 = precision.POLICIES["fp32"]
    spec = builder.model_spec(trainer.tiny_config(), fp32)
    assert spec.loss is family.LLAMA.loss  # next_token is the family's own loss, unwrapped
    with pytest.raises(UsageError, match="--objective .kto. is not one of next_token, dpo, orpo"):
        builder.model_spec(trainer.tiny_config(), fp32, None, "kto")
