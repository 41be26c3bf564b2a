"""DiLoCo (--dcn-sync diloco): H = 1 with outer lr 1 and no momentum is synchronous data
parallelism; the compiled programs all-reduce the params over the replicas once per round and
no gradient crosses them in between; a resume in the middle of a round is bitwise."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import spmd
from models import llama
from spmd.engine import diloco, precision
from spmd.engine.state_layout import sharded_bytes
from spmd.engine.step import TrainState
from spmd.errors import UsageError
from spmd.estimate import hlo
from spmd.io import checkpoint, checkpoint_restore, data
from tests import trainer
from tests.cli import run

MESH = "dp=2,fsdp=2"  # 2 replicas, each a ZeRO-3 group of 2
STEPS = 20


def make_model(seed: int):
    return llama.create(trainer.tiny_config(), seed)


@pytest.fixture(scope="module")
def programs():
    """(synchronous program, DiLoCo program with H = 1, outer lr 1, momentum 0) of the tiny
    model with SGD + momentum inside: an update linear in the gradient, so averaging the
    replicas' updates is updating with their averaged gradient."""
    mesh = trainer.layout(MESH).mesh
    tx = optax.sgd(0.2, momentum=0.9)
    # the library's road (spmd.run.builder, as the commands), with and without DiLoCo
    sync = spmd.build(make_model, llama.lm_loss, tx, mesh)
    program = spmd.build(make_model, llama.lm_loss, tx, mesh, diloco=diloco.Sync(1, 1.0, 0.0))
    return sync, program


def batch(program, step: int) -> dict:
    windows = trainer.windows()
    ids = data.train_window_ids(0, step, trainer.BATCH, windows.n_train)
    return data.global_batch(windows, ids, program.layout.batch_sharding())


def run_diloco(program, state, first: int, last: int) -> tuple[TrainState, list[float]]:
    """Steps first..last (1-based) from `state`; (the state after `last`, their losses)."""
    losses = []
    for step in range(first, last + 1):
        state, metrics = program.step(state, batch(program, step - 1), step)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_h1_with_outer_lr_1_is_synchronous_data_parallelism(programs):
    sync, program = programs
    state, expected = sync.init(), []
    for step in range(STEPS):
        state, metrics = sync.step(state, batch(sync, step))
        expected.append(float(metrics["loss"]))
    final, losses = run_diloco(program, program.init(), 1, STEPS)
    assert trainer.max_relative_difference(np.array(losses), np.array(expected)) <= 1e-5
    replicas = jax.device_get(final.params)
    for want, got in zip(
        jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(replicas), strict=True
    ):
        np.testing.assert_array_equal(got[0], got[1])  # every replica restarts from the sync
        np.testing.assert_allclose(got[0], want, rtol=1e-3, atol=1e-5)


def test_params_cross_the_replicas_once_per_round_and_no_gradients_in_between(programs):
    _, program = programs
    args = (
        program.abstract_params,
        program.abstract_opt_state,
        program.abstract_loss_scale,
        program.inner.abstract_batch(trainer.BATCH, trainer.SEQ_LEN),
    )
    mesh = program.layout.mesh
    over_replicas = {}
    for name, fn in (("local", program.local_step), ("synced", program.synced_step)):
        colls = hlo.collectives(fn.lower(*args).compile(), mesh)
        over_replicas[name] = [c for c in colls if diloco.AXIS in c.axes]
    params_bytes = sharded_bytes(program.abstract_master)  # fp32, per device (ZeRO-3 shard)
    # Inner steps: only the reported loss and gradient norm (a few scalars) cross the replicas.
    assert sum(c.bytes * c.count for c in over_replicas["local"]) <= 64
    big = [c for c in over_replicas["synced"] if c.bytes > 64]
    assert [c.kind for c in big] == ["all-reduce"] and big[0].count == 1
    assert abs(big[0].bytes - params_bytes) <= 0.01 * params_bytes
    total = sum(c.bytes * c.count for c in over_replicas["synced"])
    assert abs(total - params_bytes) <= 0.01 * params_bytes


def test_resume_in_the_middle_of_a_round_is_bitwise(programs, tmp_path):
    # The same compiled steps with H = 3: rounds end at steps 3 and 6; save after step 4.
    program = dataclasses.replace(programs[1], sync=diloco.Sync(3, 1.0, 0.0))
    state, first = run_diloco(program, program.init(), 1, 4)
    manager = checkpoint.open_manager(str(tmp_path), keep=2)
    checkpoint.save(manager, 4, program.checkpoint_view(state), {"step": 4}, {})
    manager.wait_until_finished()
    view = jax.device_get(program.checkpoint_view(state))  # before the steps donate `state`
    uninterrupted, expected = run_diloco(program, state, 5, 7)
    restored = checkpoint_restore.restore_newest(manager, program.abstract_checkpoint(), {}, print)
    manager.close()
    resumed, losses = run_diloco(program, program.from_checkpoint(restored.state), 5, 7)
    assert losses == expected
    for a, b in zip(
        jax.tree.leaves(jax.device_get(resumed)), jax.tree.leaves(uninterrupted), strict=True
    ):
        np.testing.assert_array_equal(a, jax.device_get(b))
    # The outer state is in the checkpoint: start-of-round params differ from the replicas'.
    outer, replica = jax.tree.leaves(view["params"]), jax.tree.leaves(view["replicas"]["params"])
    assert not any(np.array_equal(o, r[0]) for o, r in zip(outer, replica, strict=True))


def test_unsupported_combinations_are_refused_with_one_sentence():
    layout = trainer.layout(MESH)
    fp32, fp16 = precision.get("fp32"), precision.get("fp16")
    good = diloco.Sync(10, 0.7, 0.9)
    cases = [
        (good, "explicit", fp32, 1, "--collectives explicit"),
        (good, "auto", fp16, 1, "fp16"),
        (good, "auto", fp32, 2, "pp=2"),
        (diloco.Sync(0, 0.7, 0.9), "auto", fp32, 1, "--sync-every 0"),
        (diloco.Sync(10, 0.7, 1.0), "auto", fp32, 1, "--outer-momentum 1"),
        (diloco.Sync(10, -1.0, 0.9), "auto", fp32, 1, "--outer-lr -1"),
    ]
    for sync, executor, policy, stages, message in cases:
        with pytest.raises(UsageError, match=message):
            diloco.check(sync, layout, executor, policy, stages)
    with pytest.raises(UsageError, match="dp=1"):
        diloco.check(good, trainer.layout("fsdp=2"), "auto", fp32, 1)
    with pytest.raises(UsageError, match="--diloco-axis data"):
        diloco.check_mesh("", 1, None, dict(layout.mesh.shape))
    sizes = {"data": 2, "pipeline": 1, "fsdp": 4, "tensor": 1}
    with pytest.raises(UsageError, match="--dcn-mesh dp=2"):
        diloco.check_mesh("", 2, {"data": 1, "pipeline": 1, "fsdp": 2, "tensor": 1}, sizes)
    diloco.check_mesh("", 2, {"data": 2, "pipeline": 1, "fsdp": 1, "tensor": 1}, sizes)


def test_cli_refuses_diloco_on_one_process_without_the_replicas_axis():
    tiny = ("--model", "tiny", "--dry-run", "--mesh", "dp=2")
    # (unknown modes and bad numbers are refused by the same checks, tested above in-process)
    result = run("spmd.train", *tiny, "--dcn-sync", "diloco")
    assert result.returncode == 2, result.stderr
    assert "--diloco-axis data" in result.stderr.strip().splitlines()[-1]


def test_two_processes_as_two_replicas_train_like_one_process(tmp_path):
    """Real processes (spmd.launch, gloo): each process is one replica (--dcn-mesh dp=2), and
    the run matches one process holding both replicas on the same global mesh."""
    from tests.test_multihost import assert_same, train

    diloco_run = ("--mesh", "dp=2,fsdp=4", "--dcn-sync", "diloco", "--sync-every", "3")
    one = train(tmp_path, "one", 1, *diloco_run, "--devices", "8", "--diloco-axis", "data")
    two = train(tmp_path, "two", 2, *diloco_run, "--dcn-mesh", "dp=2")
    assert sorted(two) == [1, 2, 3, 4, 5, 6]
    assert_same(two, one)


def test_planner_replaces_the_gradient_all_reduce_over_data_by_one_params_sync_per_round(
    capsys,
):
    import json

    from spmd import plan

    base = ["--model", "1b", "--mesh", "dp=4,fsdp=8", "--devices-per-node", "8", "--json"]
    base += ["--inter-bandwidth", "1"]
    reports = []
    for extra in ([], ["--dcn-sync", "diloco", "--sync-every", "10"]):
        assert plan.main(base + extra) == 0
        reports.append(json.loads(capsys.readouterr().out))
    every, rounds = reports
    over_data = [[c for c in r["collectives"] if "data" in c["axes"]] for r in reports]
    assert [c["purpose"] for c in over_data[0]] == ["grad shards"]
    (sync,) = over_data[1]
    assert sync["purpose"] == "pseudo-gradient" and sync["count"] == pytest.approx(0.1)
    fp32_shard = rounds["params_bytes_per_device"] * 4 / cost_bytes(rounds["precision"])
    assert sync["bytes"] == pytest.approx(fp32_shard * 0.1, rel=1e-6)
    assert rounds["step_time_s"] < every["step_time_s"]


def cost_bytes(precision: str) -> int:
    from spmd.engine import precision as precision_policy

    return precision_policy.get(precision).itemsize("param")


def test_unknown_sync_mode_and_stray_diloco_axis_are_refused():
    from spmd.run.checks import check_dcn_sync
    from spmd.run.config import flat

    with pytest.raises(UsageError, match="--dcn-sync 'often' is not one of every-step, diloco"):
        check_dcn_sync(flat(None, dcn_sync="often"))
    with pytest.raises(UsageError, match="--diloco-axis data needs --dcn-sync diloco"):
        check_dcn_sync(flat(None, diloco_axis="data"))
