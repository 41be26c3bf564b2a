"""Host offload (--offload optimizer | params, --remat offload): the same losses as the run
without offload, the offloaded state in host memory (the compiled step's input shardings and
the live arrays' memory kinds) in the bytes the ZeRO formula gives, resumes across offload
settings bitwise, and the combinations the engine cannot run refused (exit 2).

On XLA:CPU every memory is host RAM and a device_put inside the jit lowers to nothing, so these
tests check placement and numerics, not transfer speed (docs/strategies/offload.md)."""

import math

import jax
import numpy as np
import pytest

import spmd
from models import llama
from spmd import builder, config, train
from spmd.config import flat
from spmd.engine import offload
from spmd.errors import UsageError
from spmd.parallel.mesh import build_mesh, parse_mesh
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


@pytest.fixture(scope="module")
def baselines() -> dict:
    """Losses of the runs without offload, by (mesh, zero)."""
    return {}


# (mesh, zero, --offload, --remat): 1 device, ZeRO-1 and ZeRO-3 over fsdp=4
CASES = [
    ("fsdp=1", 3, "optimizer", "none"),
    ("fsdp=1", 3, "params", "none"),
    ("fsdp=1", 3, "none", "offload"),
    ("fsdp=4", 1, "optimizer", "none"),
    ("fsdp=4", 3, "optimizer", "none"),
    ("fsdp=4", 3, "params", "offload"),
]


@pytest.mark.parametrize("mesh,zero,where,remat", CASES)
def test_offloaded_runs_equal_the_run_without_offload(baselines, mesh, zero, where, remat):
    if (mesh, zero) not in baselines:
        plain = program(mesh, zero)
        baselines[mesh, zero] = train_from(plain, plain.init(), 0, STEPS)[0]
    prog = program(mesh, zero, where, remat)
    losses, state = train_from(prog, prog.init(), 0, STEPS)
    np.testing.assert_allclose(losses, baselines[mesh, zero], rtol=1e-6)
    host = set(offload.HOST_ROLES[where])
    assert memory_kinds(state.opt_state) == {"pinned_host" if "opt_state" in host else "device"}
    assert memory_kinds(state.params) == {"pinned_host" if "params" in host else "device"}
    if remat == "offload":  # the saved matmul outputs go to host memory in the traced step
        traced = jax.make_jaxpr(prog.train_step)(*state, batch_at(prog, text_windows(), 0))
        assert "MemorySpace.Host" in str(traced)


@pytest.mark.parametrize("where", ["optimizer", "params"])
def test_compiled_step_takes_the_offloaded_state_in_host_memory(where):
    plain, prog = program("fsdp=4", 3), program("fsdp=4", 3, where, collectives="explicit")
    before = offload.state_bytes_by_memory(plain.compile_train_step(BATCH, SEQ_LEN), plain)
    compiled = prog.compile_train_step(BATCH, SEQ_LEN)
    after = offload.state_bytes_by_memory(compiled, prog)
    # fp32 ZeRO-3 over 4: Adam's m and v (8 B/param) and the params (4 B/param) split 4 ways
    p, fsdp = n_params(prog), 4
    assert after["opt_state"]["device"] <= 0.05 * before["opt_state"]["device"]
    assert after["opt_state"]["host"] == pytest.approx(8 * p / fsdp, rel=0.01)
    want_params_host = 4 * p / fsdp if where == "params" else 0
    assert after["params"]["host"] == pytest.approx(want_params_host, rel=0.01)
    # the compiled program's own entry layout marks host-memory arguments: memory space 5
    entry = next(
        line for line in compiled.as_text().splitlines() if "entry_computation_layout" in line
    )
    host_arguments = entry.split("->")[0].count("S(5)")
    leaves = jax.tree.leaves(prog.abstract_opt_state)
    if where == "params":
        leaves += jax.tree.leaves(prog.abstract_params)
    assert host_arguments == len(leaves)


def test_resume_offloaded_to_not_offloaded_and_back_is_bitwise(tmp_path):
    plain = program("fsdp=4", 3, precision="bf16")
    offloaded = program("fsdp=4", 3, "params", precision="bf16")
    straight = train_from(plain, plain.init(), 0, 6)[0]
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
    assert first + second + third == straight


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


def test_dry_run_shows_device_and_host_bytes_beside_the_formula(capsys):
    args = ["--model", "tiny", "--mesh", "fsdp=4", "--batch", "8", "--seq-len", "32"]
    assert train.main([*args, "--offload", "optimizer", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--offload optimizer: in host memory optimizer state 0.53 MiB" in out
    split = "--offload optimizer, params + master + optimizer per device: device memory 0.27 MiB"
    assert f"{split} compiled vs 0.27 MiB formula; host memory 0.53 MiB compiled vs 0.53" in out
