"""Tests for the planner (spmd.estimate.cost, spmd.estimate.recommend, spmd.estimate.measure,
`python -m spmd.plan`):
the textbook worked numbers, agreement with the compiled step, and the command line."""

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import pytest

from models import llama
from spmd import config, plan
from spmd.config import TrainConfig
from spmd.engine.step import sharded_bytes
from spmd.estimate import cost, measure, recommend

ROOT = Path(__file__).resolve().parents[1]


def run_plan(capsys, *args: str) -> dict:
    assert plan.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def setup_2b(**changes) -> cost.Setup:
    """The ZeRO paper's kind of example: 2 B params on 8 devices."""
    values = dict(
        shape=types.SimpleNamespace(**cost.llama_shape(2e9), remat="none"),
        n_params=2e9,
        mesh={"data": 1, "pipeline": 1, "fsdp": 8, "tensor": 1},
        zero=3,
        precision="fp32",
        optimizer="adamw",
        batch=8,
        seq_len=128,
        accum=1,
    )
    return cost.Setup(**{**values, **changes})


def test_ring_all_reduce_worked_example():
    # 400 MB over 4 devices at 25 GB/s, 5 us per step: 2*3/4 * 16 ms = 24.0 ms (+ 30 us).
    seconds = cost.ring_time("all-reduce", 400e6, 4, 25e9, 5e-6)
    assert seconds == pytest.approx(24.0e-3, abs=0.05e-3)
    assert cost.ring_time("all-reduce", 400e6, 4, 25e9, 0.0) == pytest.approx(24.0e-3)
    assert cost.ring_time("all-gather", 400e6, 4, 25e9, 0.0) == pytest.approx(12.0e-3)
    assert cost.wire_bytes(cost.Comm("all-reduce", ("data",), 4, 400e6, 1, "")) == 600e6


def test_2b_params_zero3_over_8_devices_fits_16_gb():
    for precision in ("fp32", "mixed"):  # 4+4+8 and the ZeRO paper's 2+2+12 B/param
        s = setup_2b(precision=precision)
        assert sum(cost.bytes_per_param(s).values()) == 16
        mem = cost.memory(s, overhead=3e9, hbm=16e9)
        assert mem["model_state"] == pytest.approx(4e9)
        assert mem["total"] - mem["activations"] == pytest.approx(7e9)
        assert mem["fits"] and mem["headroom"] == pytest.approx(16e9 - mem["total"])


@pytest.mark.parametrize("zero, expected", [(0, 32e9), (1, 11e9), (2, 7.5e9), (3, 4e9)])
def test_zero_stages_follow_the_zero_paper(zero, expected):
    # Psi = 2e9, K = 12, N = 8: (2+2+K)Psi, (2+2)Psi + K Psi/N, 2Psi + (2+K)Psi/N, (2+2+K)Psi/N.
    s = setup_2b(precision="mixed", zero=zero)
    assert cost.model_state_bytes(s)["model_state"] == pytest.approx(expected)


def test_communication_volume_per_layout():
    # Bytes each device sends per step: DDP 2(N-1)/N P; ZeRO-2 the same; ZeRO-1 and -3 1.5x.
    def sent(s):
        return sum(cost.wire_bytes(c) * c.count for c in cost.collectives(s))

    ddp = sent(setup_2b(zero=0))
    assert ddp == pytest.approx(2 * 7 / 8 * 8e9)
    assert sent(setup_2b(zero=2)) == pytest.approx(ddp)
    assert sent(setup_2b(zero=1)) == pytest.approx(1.5 * ddp)
    # ZeRO-3 gathers the embedding and head once per step, the blocks twice.
    tables = cost.params_per_device(setup_2b(), fsdp_shards=False, layers=False) * 4
    assert sent(setup_2b(zero=3)) == pytest.approx(1.5 * ddp - 7 / 8 * tables)
    tp = setup_2b(mesh={"data": 2, "pipeline": 1, "fsdp": 1, "tensor": 4}, zero=0, accum=2)
    (activations,) = [c for c in cost.collectives(tp) if c.axes == ("tensor",)]
    layers = tp.shape.n_layers
    assert activations.count == 2 * (4 * layers + 2)  # per micro-batch: 4 per block + 2
    assert activations.bytes == 2 * 128 * tp.shape.embed_dim * 4  # micro-batch 2 x seq x embed


def test_activation_formula_for_tiny():
    shape = config.build(llama.LlamaConfig, config.preset("tiny"), "tiny")
    s = setup_2b(shape=shape, n_params=shape.n_params(), batch=16, seq_len=64)
    b, t = 2, 64  # 16 sequences over 8 devices
    block = b * t * (4 * 64 + (8 + 2 * 4) * 8 + 8 * 8 + 4 * 256) + b * 8 * t * t
    outside = 2 * b * t * 64 * 4 + 2 * b * t * 256 * 4
    assert cost.activation_bytes(s) == 4 * (4 * block) + outside
    remat = dataclasses.replace(s, shape=dataclasses.replace(shape, remat="full"))
    assert cost.activation_bytes(remat) == 4 * (4 * b * t * 64) + outside + 4 * block


def test_batch_arithmetic_and_linear_lr(capsys):
    assert cost.global_batch(8, 16, 2) == 256
    args = ["--model", "tiny", "--devices", "16", "--mesh", "dp=16", "--accum", "2"]
    args += ["--lr", "3e-4", "--lr-scaling", "linear", "--ref-batch", "256"]
    batch = run_plan(capsys, *args, "--batch", "256")["batch"]
    assert (batch["micro_batch_per_device"], batch["data_parallel"], batch["accum"]) == (8, 16, 2)
    assert batch["global"] == 256 and batch["peak_lr"] == pytest.approx(3e-4)
    assert run_plan(capsys, *args, "--batch", "512")["batch"]["peak_lr"] == pytest.approx(6e-4)


def test_cli_json_for_2b_zero3(capsys):
    out = run_plan(
        capsys, "--params", "2e9", "--devices", "8", "--zero", "3", "--hbm", "16",
        "--overhead", "3", "--batch", "8", "--seq-len", "128",
    )  # fmt: skip
    assert out["mesh_text"] == "fsdp=8" and out["zero"] == 3
    assert out["model_state_bytes_per_device"] == 4_000_000_000
    assert out["total_bytes_per_device"] - out["activation_bytes_per_device"] == 7_000_000_000
    assert out["fits"] is True
    blocks = cost.params_per_device(setup_2b(), fsdp_shards=False, layers=True) * 4
    assert out["comm_bytes_per_step"] == {
        "reduce-scatter": 1e9,
        "all-gather": pytest.approx(8e9 + blocks, abs=1),
    }
    assert out["comm_compute_ratio"] == pytest.approx(out["comm_time_s"] / out["compute_time_s"])


LAYOUTS = [
    ("dp=8", 0),
    ("fsdp=8", 1),
    ("fsdp=8", 2),
    ("fsdp=8", 3),
    ("dp=2,fsdp=4", 3),
    ("dp=2,fsdp=2,tp=2", 3),
    ("fsdp=2,tp=4", 2),
    ("pp=2,fsdp=4", 3),
    ("dp=2,pp=2,tp=2", 1),
]


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_state_bytes_agree_with_the_engine_across_layouts(preset):
    """Analytic params + optimizer state per device vs the shardings the engine's jitted step
    takes its state in (its explicit in_shardings, which spmd.engine.step.state_bytes_per_device
    reads back from the compiled step; test_measure_compiles checks that they agree)."""
    shape = config.build(llama.LlamaConfig, config.preset(preset), preset)
    from spmd.parallel.mesh import parse_mesh

    for mesh, zero in LAYOUTS:
        sizes = parse_mesh(mesh)
        s = setup_2b(shape=shape, n_params=shape.n_params(), mesh=sizes, zero=zero, batch=16)
        cost.check_setup(s)
        program, _ = measure.build(
            s, lambda seed, dtype: llama.create(shape, seed, dtype), llama.lm_loss,
            TrainConfig(), jax.devices()[:8],
        )  # fmt: skip
        engine = sharded_bytes(program.abstract_params) + sharded_bytes(program.abstract_opt_state)
        state = cost.model_state_bytes(s)
        analytic = state["params"] + state["optimizer"]
        assert engine == pytest.approx(analytic, rel=1e-3), (preset, mesh, zero)  # issue: 5%


def test_measure_compiles_and_agrees(capsys):
    out = run_plan(
        capsys, "--model", "tiny", "--mesh", "dp=2,fsdp=2,tp=2", "--zero", "3",
        "--batch", "16", "--seq-len", "64", "--measure",
    )  # fmt: skip
    rows = out["measured"]["rows"]
    state = rows["params + optimizer state"]
    assert state["ratio"] == pytest.approx(1.0, rel=1e-3)  # the issue asks 5%
    expected = out["params_bytes_per_device"] + out["optimizer_bytes_per_device"]
    assert state["analytic"] == expected
    # The collective kinds the textbook predicts are the ones compiled (reduce-scatter shows
    # as all-reduce on XLA:CPU), and the ZeRO-3 all-gathers of params agree.
    assert {k.split()[0] for k in rows if k.endswith("bytes/step")} == {"all-reduce", "all-gather"}
    assert rows["all-gather bytes/step"]["ratio"] == pytest.approx(1.0, rel=0.02)
    assert "reduce-scatter" in out["measured"]["notes"][0]


def test_recommend_fits_first_and_keeps_tp_in_a_node(capsys):
    out = run_plan(
        capsys, "--params", "2e9", "--devices", "16", "--devices-per-node", "4", "--hbm", "16",
        "--overhead", "3", "--batch", "16", "--seq-len", "128", "--recommend",
    )  # fmt: skip
    rec = out["recommendation"]
    assert out["fits"] and out["mesh"]["tensor"] <= 4
    assert any(line.startswith("dp=16 alone (DDP) needs") for line in rec["reasons"])
    assert any(line.startswith("memory:") for line in rec["reasons"])
    # It is the least communication + bubble per compute of all fitting layouts.
    base = setup_2b(mesh={"data": 16, "pipeline": 1, "fsdp": 1, "tensor": 1}, batch=16)
    net = cost.Network(400e9, 50e9, 5e-6, 4)
    scored = [recommend.score(s, net, 400e12, 3e9, 16e9) for s in recommend.layouts(base, 16, 4)]
    assert all(s.setup.mesh["tensor"] <= 4 for s in scored)
    fitting = [s for s in scored if s.memory["fits"]]
    best = min(s.overhead_ratio for s in fitting)
    chosen = [s for s in fitting if s.label() == f"{rec['mesh_text']} zero {rec['zero']}"]
    assert chosen and chosen[0].overhead_ratio == pytest.approx(best, rel=1e-3)


def test_recommend_when_nothing_fits(capsys):
    out = run_plan(capsys, "--params", "7e9", "--devices", "2", "--hbm", "16", "--recommend")
    assert out["fits"] is False
    assert any("does NOT fit" in line for line in out["recommendation"]["reasons"])


@pytest.mark.parametrize(
    "args, named",
    [
        (["--precision", "fp8"], "--precision 'fp8'"),
        (["--zero", "4"], "--zero 4"),
        (["--model", "tiny", "--mesh", "tp=3", "--devices", "3"], "tp=3"),
        (["--params", "7e9", "--n-layers", "4"], "--n-layers"),
        (["--hbm", "0"], "--hbm 0"),
        (["--model", "tiny", "--batch", "12", "--devices", "8"], "--batch 12"),
        (["--model", "tiny", "--precision", "mixed", "--measure"], "--measure"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, named):
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and err.count("\n") == 1


def test_module_entry_point_help_and_errors():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "spmd.plan"]
    shown = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert shown.returncode == 0
    for flag in ("--params", "--devices", "--zero", "--precision", "--hbm", "--overhead"):
        assert flag in shown.stdout
    assert "--bandwidth" in shown.stdout and "GB (1e9 bytes)" in shown.stdout
    bad = subprocess.run([*cmd, "--zero", "9"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    table = subprocess.run(
        [*cmd, "--model", "tiny", "--devices", "4", "--batch", "8"],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert table.returncode == 0
    assert "1 GB = 1e9 bytes" in table.stdout and "fits" in table.stdout


def test_layouts_and_train_command_lines_are_planned(capsys):
    # A named layout sets mesh and stage; train-only flags are accepted and change nothing.
    out = run_plan(capsys, "--model", "tiny", "--layout", "zero2", "--devices", "8", "--steps", "9")
    assert (out["mesh_text"], out["zero"]) == ("fsdp=8", 2)
    assert (
        run_plan(capsys, "--model", "tiny", "--zero", "0", "--devices", "4")["mesh_text"] == "dp=4"
    )


def test_a_flag_has_one_owner_when_train_config_gains_it():
    @dataclasses.dataclass(frozen=True)
    class Train:
        precision: str = "bf16"

    section = plan._own_fields(plan.PlanConfig, Train)
    names = [f.name for f in dataclasses.fields(section)]
    assert "precision" not in names and "hbm" in names
    assert section().hbm == plan.PlanConfig().hbm
