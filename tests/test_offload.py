"""Host offload (--offload optimizer | params, --remat offload): the same losses as the run
without offload, the offloaded state in host memory (the compiled step's input shardings and
the live arrays' memory kinds) in the bytes the ZeRO formula gives, resumes across offload
settings bitwise, and the combinations the engine cannot run refused (exit 2).

On XLA:CPU every memory is host RAM and a device_put inside the jit lowers to nothing, so these
tests check placement and numerics, not transfer speed (docs/strategies/offload.md)."""

import dataclasses
import math

import jax
import numpy as np
import pytest

import spmd
from models import llama
from spmd import train
from spmd.engine import offload
from spmd.engine.step import TrainState
from spmd.errors import UsageError
from spmd.parallel.mesh import build_mesh, parse_mesh
from spmd.run import builder, config
from spmd.run.config import flat
from tests.tiny_run import BATCH, SEQ_LEN, batch_at, text_windows

STEPS = 10


def program(mesh: str, zero: int = 3, offload: str = "none", remat: str = "none", **more):
    model = llama.LlamaConfig(**{**config.preset("tiny"), "remat": remat})
    cfg = flat(
        model,
        batch=BATCH,
        seq_len=SEQ_LEN,
        warmup=5,
        mesh=mesh,
        zero=zero,
        offload=offload,
        **more,
    )
    sizes = parse_mesh(mesh)
    devices = jax.devices()[: math.prod(sizes.values())]
    return builder.program(cfg, build_mesh(sizes, devices))


def train_from(prog, state, first: int, last: int) -> tuple[list[float], object]:
    windows = text_windows()
    losses = []
    for step in range(first, last):
        state, metrics = prog.step(state, batch_at(prog, windows, step))
        losses.append(float(metrics["loss"]))
    return losses, state


def memory_kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def n_params(prog) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(prog.abstract_params))


@dataclasses.dataclass
class Run:
    """One layout's program, its train step compiled once (AOT) and STEPS steps run with that
    executable: the tests read the compiled program and the live arrays of the same run."""

    prog: object  # the Program, its train_step the jitted step
    compiled: object
    losses: list[float]
    state: object  # after STEPS steps


def initial_state(prog, initial: dict) -> TrainState:
    """`prog`'s initial state: its own init the first time, then that state placed as `prog`
    lays it out (its mesh, and the memories --offload keeps it in). The values do not depend
    on the mesh (JAX's partitionable threefry; the resume test starts from an init of its own
    and compares with these runs), and each init costs a compile."""
    if not initial:
        state = prog.init()
        initial["state"] = jax.device_get(state)
        return state
    abstract = TrainState(prog.abstract_params, prog.abstract_opt_state, prog.abstract_loss_scale)
    return jax.device_put(initial["state"], jax.tree.map(lambda a: a.sharding, abstract))


@pytest.fixture(scope="module")
def runs():
    """run(mesh, zero, offload, remat, collectives): the Run of that layout, built on first
    use and shared by the tests of this module (compiling is most of their time)."""
    cache, initial = {}, {}

    def run(mesh, zero, offload="none", remat="none", collectives="auto") -> Run:
        key = (mesh, zero, offload, remat, collectives)
        if key not in cache:
            prog = program(mesh, zero, offload, remat, collectives=collectives)
            compiled = prog.compile_train_step(BATCH, SEQ_LEN)
            stepping = dataclasses.replace(prog, train_step=compiled)
            losses, state = train_from(stepping, initial_state(prog, initial), 0, STEPS)
            cache[key] = Run(prog, compiled, losses, state)
        return cache[key]

    return run


# (mesh, zero, --offload, --remat, executor), each against the same layout without offload:
# 1 device, ZeRO-1 and ZeRO-3 over fsdp=4, both executors. `params` keeps the optimizer state
# on the host too, so it covers `optimizer` there; `--remat offload` rides along where the
# same program can carry it (one compile less per case), not on the ZeRO-3 pair, which the
# resume test needs bitwise equal.
CASES = [
    ("fsdp=1", 3, "params", "offload", "auto"),
    ("fsdp=4", 1, "optimizer", "offload", "auto"),
    ("fsdp=4", 3, "params", "none", "explicit"),
]


@pytest.mark.parametrize("mesh,zero,where,remat,executor", CASES)
def test_offloaded_runs_equal_the_run_without_offload(runs, mesh, zero, where, remat, executor):
    plain, run = runs(mesh, zero, collectives=executor), runs(mesh, zero, where, remat, executor)
    np.testing.assert_allclose(run.losses, plain.losses, rtol=1e-6)
    host = set(offload.HOST_ROLES[where])
    state = run.state
    assert memory_kinds(state.opt_state) == {"pinned_host" if "opt_state" in host else "device"}
    assert memory_kinds(state.params) == {"pinned_host" if "params" in host else "device"}
    if remat == "offload":  # the saved matmul outputs go to host memory in the traced step
        traced = jax.make_jaxpr(run.prog.train_step)(*state, batch_at(run.prog, text_windows(), 0))
        assert "MemorySpace.Host" in str(traced)


# --offload optimizer under ZeRO-1, params under ZeRO-3 (explicit executor): the runs above
@pytest.mark.parametrize(
    "zero,where,remat,executor",
    [(1, "optimizer", "offload", "auto"), (3, "params", "none", "explicit")],
)
def test_compiled_step_takes_the_offloaded_state_in_host_memory(runs, zero, where, remat, executor):
    plain, run = (
        runs("fsdp=4", zero, collectives=executor),
        runs("fsdp=4", zero, where, remat, executor),
    )
    before = offload.state_bytes_by_memory(plain.compiled, plain.prog)
    after = offload.state_bytes_by_memory(run.compiled, run.prog)
    # fp32 over fsdp=4: Adam's m and v (8 B/param) split 4 ways from ZeRO-1, the params
    # (4 B/param) from ZeRO-3
    p, fsdp = n_params(run.prog), 4
    assert after["opt_state"]["device"] <= 0.05 * before["opt_state"]["device"]
    assert after["opt_state"]["host"] == pytest.approx(8 * p / fsdp, rel=0.01)
    want_params_host = 4 * p / fsdp if where == "params" else 0
    assert after["params"]["host"] == pytest.approx(want_params_host, rel=0.01)
    # the compiled program's own entry layout marks host-memory arguments: memory space 5
    entry = next(
        line for line in run.compiled.as_text().splitlines() if "entry_computation_layout" in line
    )
    host_arguments = entry.split("->")[0].count("S(5)")
    leaves = jax.tree.leaves(run.prog.abstract_opt_state)
    if where == "params":
        leaves += jax.tree.leaves(run.prog.abstract_params)
    assert host_arguments == len(leaves)


def test_resume_offloaded_to_not_offloaded_and_back_is_bitwise(runs, tmp_path):
    """ZeRO-3 over fsdp=4, fp32: 2 steps with --offload params, 2 without, 2 with again, each
    resumed from the last one's checkpoint, against the first 6 of the uninterrupted run's
    losses (the compiled steps of the runs above: no compile here)."""
    plain_run, offloaded_run = (
        runs("fsdp=4", 3, collectives="explicit"),
        runs("fsdp=4", 3, "params", collectives="explicit"),
    )
    plain, offloaded = (
        dataclasses.replace(r.prog, train_step=r.compiled) for r in (plain_run, offloaded_run)
    )
    first, state = train_from(offloaded, offloaded.init(), 0, 2)
    manager = spmd.checkpoints(str(tmp_path))
    spmd.save(manager, 2, state, {}, program=offloaded)
    manager.wait_until_finished()
    _, state, _ = spmd.restore(manager, plain)
    assert memory_kinds(state.opt_state) == {"device"}
    second, state = train_from(plain, state, 2, 4)
    spmd.save(manager, 4, state, {}, program=plain)
    manager.wait_until_finished()
    _, state, _ = spmd.restore(manager, offloaded)  # orbax reads straight into pinned_host
    assert memory_kinds((state.params, state.opt_state)) == {"pinned_host"}
    third = train_from(offloaded, state, 4, 6)[0]
    manager.close()
    assert first + second + third == plain_run.losses[:6]


@pytest.mark.parametrize(
    "mesh,more,named",
    [
        ("fsdp=4", {"zero": 1, "offload": "params"}, "--zero 1"),
        ("pp=2,fsdp=2", {"offload": "optimizer"}, "pp > 1"),
        ("dp=2", {"offload": "optimizer", "dcn_sync": "diloco", "diloco_axis": "data"}, "diloco"),
    ],
)
def test_combinations_the_engine_cannot_run_are_refused(mesh, more, named):
    with pytest.raises(UsageError, match=named):
        program(mesh, **more)


def test_dry_run_shows_device_and_host_bytes_beside_the_formula(runs, capsys):
    """The ZeRO-1 run's layout as a command line: the same program, so its compile is the
    persistent cache's (tests/conftest.py) once the run above has compiled it."""
    runs("fsdp=4", 1, "optimizer", "offload")
    args = ["--model", "tiny", "--mesh", "fsdp=4", "--zero", "1", "--batch", str(BATCH)]
    args += ["--seq-len", str(SEQ_LEN), "--warmup", "5", "--remat", "offload"]
    assert train.main([*args, "--offload", "optimizer", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--offload optimizer: in host memory optimizer state 0.53 MiB" in out
    split = "--offload optimizer, params + master + optimizer per device: device memory 1.06 MiB"
    assert f"{split} compiled vs 1.06 MiB formula; host memory 0.53 MiB compiled vs 0.53" in out
