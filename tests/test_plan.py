"""Tests for the planner (spmd.estimate: cost, memory, timing, search, recommend, measure, plot;
`python -m spmd.plan`): the textbook worked numbers, the ZeRO paper's Table 1, the decision
rules of an experienced engineer, agreement with the compiled step, and the command line."""

import contextlib
import dataclasses
import functools
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from models import blockwise_attention, llama, moe
from models.blockwise_attention import BLOCK_K
from spmd import plan
from spmd.engine.state_layout import sharded_bytes
from spmd.estimate import (
    comms,
    cost,
    long_sequence,
    memory,
    pipeline_figures,
    plot,
    search,
    shape,
    theory,
    timing,
)
from spmd.estimate import offload as offload_model
from spmd.estimate.flops import decoder_flops_per_token, hlo_dot_flops
from spmd.model_shape import ModelShape
from spmd.parallel import schedules
from spmd.parallel.mesh import MESH_AXES, parse_mesh
from spmd.run import config, plan_flags, resolve

ROOT = Path(__file__).resolve().parents[1]


def run_plan(capsys, *args: str) -> dict:
    assert plan.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@functools.cache
def planned(*args: str) -> dict:
    """`python -m spmd.plan ARGS --json`, run once per distinct command line in this session."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert plan.main([*args, "--json"]) == 0
    return json.loads(out.getvalue())


def setup_2b(**changes) -> cost.Setup:
    """The ZeRO paper's kind of example: 2 B params on 8 devices."""
    values = dict(
        shape=ModelShape(**shape.release_for(2e9).fields()),
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
    seconds = comms.ring_time("all-reduce", 400e6, 4, 25e9, 5e-6)
    assert seconds == pytest.approx(24.0e-3, abs=0.05e-3)
    assert comms.ring_time("all-reduce", 400e6, 4, 25e9, 0.0) == pytest.approx(24.0e-3)
    assert comms.ring_time("all-gather", 400e6, 4, 25e9, 0.0) == pytest.approx(12.0e-3)
    assert comms.wire_bytes(comms.Comm("all-reduce", ("data",), 4, 400e6, 1, "")) == 600e6


def test_2b_params_zero3_over_8_devices_fits_16_gb():
    for precision in ("fp32", "bf16"):  # 4+4+8 and the ZeRO paper's 2+2+12 B/param
        s = setup_2b(precision=precision)
        assert sum(memory.bytes_per_param(s).values()) == 16
        mem = memory.memory(s, overhead=3e9, hbm=16e9)
        assert mem["model_state"] == pytest.approx(4e9)
        assert mem["total"] - mem["activations"] == pytest.approx(7e9)
        assert mem["fits"] and mem["headroom"] == pytest.approx(16e9 - mem["total"])


@pytest.mark.parametrize("zero, expected", [(0, 32e9), (1, 11e9), (2, 7.5e9), (3, 4e9)])
def test_zero_stages_follow_the_zero_paper(zero, expected):
    # Psi = 2e9, K = 12, N = 8: (2+2+K)Psi, (2+2)Psi + K Psi/N, 2Psi + (2+K)Psi/N, (2+2+K)Psi/N.
    s = setup_2b(precision="bf16", zero=zero)
    assert memory.model_state_bytes(s)["model_state"] == pytest.approx(expected)


def test_communication_volume_per_layout():
    # Bytes each device sends per step: DDP 2(N-1)/N P; ZeRO-2 the same; ZeRO-1 and -3 1.5x.
    def sent(s):
        return sum(comms.wire_bytes(c) * c.count for c in comms.collectives(s))

    ddp = sent(setup_2b(zero=0))
    assert ddp == pytest.approx(2 * 7 / 8 * 8e9)
    assert sent(setup_2b(zero=2)) == pytest.approx(ddp)
    assert sent(setup_2b(zero=1)) == pytest.approx(1.5 * ddp)
    # ZeRO-3 gathers the embedding and head once per step, the blocks twice.
    tables = cost.params_per_device(setup_2b(), fsdp_shards=False, layers=False) * 4
    assert sent(setup_2b(zero=3)) == pytest.approx(1.5 * ddp - 7 / 8 * tables)
    tp = setup_2b(mesh={"data": 2, "pipeline": 1, "fsdp": 1, "tensor": 4}, zero=0, accum=2)
    (activations,) = [c for c in comms.collectives(tp) if c.purpose == "activations"]
    layers = tp.shape.n_layers
    assert activations.count == 2 * (4 * layers + 2)  # per micro-batch: 4 per block + 2
    assert activations.bytes == 2 * 128 * tp.shape.embed_dim * 4  # micro-batch 2 x seq x embed


def test_activation_formula_for_tiny():
    shape = config.build(llama.LlamaConfig, config.preset("tiny"), "tiny")
    s = setup_2b(shape=shape.shape(), n_params=shape.n_params(), batch=16, seq_len=64)
    b, t = 2, 64  # 16 sequences over 8 devices
    block = b * t * (4 * 64 + (8 + 2 * 4) * 8 + 8 * 8 + 3 * 256)  # gate, up, silu(gate) * up
    outside = 2 * b * t * 64 * 4 + 2 * b * t * 256 * 4
    # one layer's recomputed probabilities, 3 fp32 buffers; 2 query chunks at length 64 compute
    # 3/4 of the length x length scores
    scores = 3 * b * 8 * t * t * 3 / 4 * 4
    layer = 64 * 8 * (2 * 8 + 2 * 4) + 3 * 64 * 256 + 2 * 64  # ZeRO-3 gathers one whole layer
    assert memory.activation_bytes(s) == 4 * (4 * block) + outside + scores + 4 * layer
    remat = dataclasses.replace(s, remat="full")
    want = 4 * (4 * b * t * 64) + outside + 4 * block + scores + 4 * layer
    assert memory.activation_bytes(remat) == want


def test_step_time_counts_recomputation_bubble_and_what_overlap_hides():
    net = cost.Network(400e9, 50e9, 0.0, 8)
    s = setup_2b(mesh={"data": 2, "pipeline": 1, "fsdp": 1, "tensor": 4}, zero=0)
    f = timing.forward_flops_per_token(s)
    tokens = s.batch * s.seq_len
    assert timing.model_flops(s) == 3 * tokens * sum(f.values())
    # the causal kernel computes `share` of the scores (its key blocks at or before each query
    # block's); without remat the backward pass recomputes them (one of attention's matmuls)
    share = long_sequence.score_share(s.seq_len, 1)
    attention, skipped = f["attention"] * share, 3 * f["attention"] * (1 - share)
    assert share == 5 / 8  # 128 tokens: 4 query chunks
    assert timing.executed_flops(s) - timing.model_flops(s) == pytest.approx(
        tokens * (attention / 2 - skipped), rel=1e-12
    )
    full = dataclasses.replace(s, remat="full")  # every block's forward again
    assert timing.executed_flops(full) - timing.model_flops(s) == pytest.approx(
        tokens * (f["blocks"] + attention - skipped), rel=1e-12
    )
    dots = dataclasses.replace(s, remat="dots_saveable")  # attention only
    assert timing.executed_flops(dots) - timing.model_flops(s) == pytest.approx(
        tokens * (attention - skipped), rel=1e-12
    )
    t = timing.step_time(s, net, 400e12)
    assert t["step"] == t["compute"] + t["comm"] and t["bubble"] == 0
    times = {c.purpose: comms.comm_time(s, c, net) for c in comms.collectives(s)}
    hidden = timing.step_time(s, net, 400e12, overlap=1.0)  # behind compute, at most all of it
    assert hidden["hidden"] == min(times["gradients"], t["compute"]) == t["compute"]
    big = dataclasses.replace(s, batch=512, seq_len=2048)
    times = {c.purpose: comms.comm_time(big, c, net) for c in comms.collectives(big)}
    hidden = timing.step_time(big, net, 400e12, overlap=1.0)  # the gradients hide entirely
    assert hidden["exposed"] == pytest.approx(times["activations"] + times["cross-entropy sums"])
    piped = setup_2b(
        mesh={"data": 1, "pipeline": 4, "fsdp": 1, "tensor": 1}, zero=0, microbatches=8
    )
    p = timing.step_time(piped, net, 400e12)  # bubble (p - 1) / (M + p - 1) of the step
    assert p["bubble"] / (p["compute"] + p["bubble"]) == pytest.approx(3 / 11)


def test_batch_arithmetic_and_linear_lr(capsys):
    assert cost.global_batch(8, 16, 2) == 256
    args = ["--model", "tiny", "--devices", "16", "--mesh", "dp=16", "--accum", "2"]
    args += ["--lr", "3e-4", "--lr-scaling", "linear", "--ref-batch", "256"]
    out = run_plan(capsys, *args, "--batch", "256")
    batch = out["batch"]
    assert (batch["micro_batch_per_device"], batch["data_parallel"], batch["accum"]) == (8, 16, 2)
    assert batch["global"] == 256 and out["lr"]["peak_lr"] == pytest.approx(3e-4)
    assert run_plan(capsys, *args, "--batch", "512")["lr"]["peak_lr"] == pytest.approx(6e-4)


def test_cli_json_for_2b_zero3(capsys):
    out = run_plan(
        capsys, "--params", "2e9", "--devices", "8", "--zero", "3", "--hbm", "16",
        "--overhead", "3", "--batch", "8", "--seq-len", "128", "--precision", "fp32",
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
    takes its state in (its explicit in_shardings, which
    spmd.engine.state_layout.state_bytes_per_device reads back from the compiled step;
    test_measure_compiles checks that they agree)."""
    shape = config.build(llama.LlamaConfig, config.preset(preset), preset)
    from spmd.parallel.mesh import parse_mesh

    for mesh, zero in LAYOUTS:
        sizes = parse_mesh(mesh)
        s = setup_2b(
            shape=shape.shape(),
            n_params=shape.n_params(),
            mesh=sizes,
            zero=zero,
            batch=16,
            microbatches=4,
        )
        cost.check_setup(s)
        program, _ = plan.engine_program(s, shape, jax.devices()[:8])
        engine = sharded_bytes(program.abstract_params) + sharded_bytes(program.abstract_opt_state)
        state = memory.model_state_bytes(s)
        analytic = state["params"] + state["optimizer"]
        assert engine == pytest.approx(analytic, rel=1e-3), (preset, mesh, zero)  # issue: 5%


def test_measure_compiles_and_agrees(capsys):
    out = run_plan(
        capsys, "--model", "tiny", "--mesh", "dp=2,fsdp=2,tp=2", "--zero", "3",
        "--batch", "16", "--seq-len", "64", "--precision", "fp32", "--measure",
    )  # fmt: skip
    rows = out["measured"]["rows"]
    for row, role in (("params", "params"), ("master + optimizer state", "optimizer")):
        assert rows[row]["ratio"] == pytest.approx(1.0, rel=1e-3)  # the issue asks 5%
        assert rows[row]["analytic"] == out[f"{role}_bytes_per_device"]
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
    assert (
        rec["reasons"][0].startswith("plain DDP keeps 16 B/param") and "over" in rec["reasons"][0]
    )
    assert any(line.startswith("memory:") for line in rec["reasons"])
    # It is the fastest of every fitting candidate, which the search enumerates itself.
    base = setup_2b(mesh={"data": 16, "pipeline": 1, "fsdp": 1, "tensor": 1}, batch=16)
    base = dataclasses.replace(base, precision="bf16")
    cluster = search.Cluster(cost.Network(400e9, 50e9, 5e-6, 4), 400e12, 16e9, 3e9)
    every = list(search.candidates(base, search.Space(batch=16), cluster))
    assert all(c.setup.mesh["tensor"] <= 4 for c in every)
    assert {c.setup.remat for c in every} == set(cost.SEARCHED_REMATS) - {"offload"}
    # host memory (--remat offload, --offload optimizer) only in the search's last pass
    assert not any(offload_model.uses_host(c.setup) for c in every)
    fitting = [c for c in every if c.memory["fits"]]
    # ... up to the search's ties (equal to 3 significant digits go to the simpler layout)
    assert out["step_time_s"] == pytest.approx(min(c.step_s for c in fitting), rel=5e-3)
    assert rec["runner_ups"] and all(
        r["step_time_s"] >= out["step_time_s"] * (1 - 5e-3) for r in rec["runner_ups"]
    )


def test_recommend_when_nothing_fits(capsys):
    out = run_plan(capsys, "--params", "7e9", "--devices", "2", "--hbm", "16", "--recommend")
    assert out["fits"] is False
    assert any("does NOT fit" in line for line in out["recommendation"]["reasons"])


@pytest.mark.parametrize(
    "args, named",
    [
        (["--precision", "fp8", "--fp8-recipe", "bogus"], "--fp8-recipe 'bogus'"),
        (["--zero", "4"], "--zero 4"),
        (["--model", "tiny", "--mesh", "tp=3", "--devices", "3"], "tp=3"),
        (["--params", "7e9", "--n-layers", "4"], "--n-layers"),
        (["--hbm", "0"], "--hbm 0"),
        (["--model", "tiny", "--batch", "12", "--devices", "8"], "--batch 12"),
        (["--model", "tiny", "--precision", "fp16", "--measure"], "--measure"),
        (["--precision", "mixed"], "--precision 'mixed'"),
        (["--precision", "fp32", "--grad-reduce", "bf16"], "--grad-reduce 'bf16'"),
        (["--params", "7e9", "--devices", "8", "--recommend", "--accum", "4"], "--accum"),
        (["--overlap", "2"], "--overlap 2"),
        (["--gpu", "tpu"], "--gpu 'tpu'"),
        (["--model", "tiny", "--mesh", "pp=2", "--pp-schedule", "zigzag"], "'zigzag'"),
        (["--model", "moe-small", "--mesh", "ep=3", "--batch", "6"], "n_experts=8"),
        (["--model", "tiny", "--mesh", "ep=2", "--batch", "2"], "ep=2"),
        (["--model", "tiny", "--mesh", "ep=2,fsdp=-1", "--recommend"], "has none"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, named):
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and err.count("\n") == 1


def test_module_entry_point_help_and_errors(capsys):
    # --help and a bad value through plan.main (the code `python -m spmd.plan` runs) ...
    assert plan.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--params", "--devices", "--zero", "--precision", "--hbm", "--overhead"):
        assert flag in out
    assert "--bandwidth" in out and "GB (1e9 bytes)" in out
    assert plan.main(["--zero", "9"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    # ... and the module entry point itself, as a user runs it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    table = subprocess.run(
        [sys.executable, "-m", "spmd.plan", "--model", "tiny", "--devices", "4", "--batch", "8"],
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


def test_a_flag_has_one_owner_when_a_run_section_gains_it():
    @dataclasses.dataclass(frozen=True)
    class Train:
        precision: str = "bf16"

    section = plan_flags.own_fields(plan_flags.PlanConfig, [Train])
    names = [f.name for f in dataclasses.fields(section)]
    assert "precision" not in names and "hbm" in names
    assert section().hbm == plan_flags.PlanConfig().hbm


# --- ZeRO memory by role: the paper's Table 1 (Rajbhandari et al. 2020) ----------------------

TABLE_1 = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.88e9}  # 7.5 B params, N_d = 64, K = 12


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_paper_table_1(zero):
    out = planned(
        "--params", "7.5e9", "--devices", "64", "--zero", str(zero), "--precision", "bf16"
    )
    psi, n = 7.5e9, 64
    expected = {
        "params": 2 * psi / (n if zero == 3 else 1),
        "grads": 2 * psi / (n if zero >= 2 else 1),
        "optimizer": 12 * psi / (n if zero >= 1 else 1),  # fp32 master + Adam m and v
    }
    for role, value in expected.items():
        assert out[f"{role}_bytes_per_device"] == pytest.approx(value, rel=1e-6), role
    assert out["model_state_bytes_per_device"] == pytest.approx(TABLE_1[zero], rel=0.01)
    # Any plan of that run shows the same four rows side by side.
    row = planned("--params", "7.5e9", "--devices", "64")["zero_stages"][zero]
    assert row["zero"] == zero and row["mesh_text"] == ("dp=64" if zero == 0 else "fsdp=64")
    assert sum(row[role] for role in expected) == pytest.approx(TABLE_1[zero], rel=0.01)


def test_gradient_dtype_sets_gradient_bytes_and_their_communication():
    args = ("--params", "7.5e9", "--devices", "64", "--zero", "0")
    bf16, fp32_reduce = planned(*args), planned(*args, "--grad-reduce", "fp32")
    assert bf16["bytes_per_param"] == {"params": 2, "grads": 2, "optimizer": 12}
    assert fp32_reduce["bytes_per_param"] == {"params": 2, "grads": 4, "optimizer": 12}
    assert bf16["comm_bytes_per_step"]["all-reduce"] == pytest.approx(2 * 7.5e9)
    assert fp32_reduce["comm_bytes_per_step"]["all-reduce"] == pytest.approx(4 * 7.5e9)
    fp32 = planned(*args, "--precision", "fp32")
    assert fp32["bytes_per_param"] == {"params": 4, "grads": 4, "optimizer": 8}  # no master


# --- planning defaults --------------------------------------------------------------------


def test_a_planning_question_gets_a_pretraining_step():
    out = planned("--params", "7.5e9", "--devices", "64")  # exited 2 with a batch of 32
    assert (out["precision"], out["batch"]["seq_len"]) == ("bf16", 4096)
    assert out["batch"]["global"] == 1024 and out["batch"]["tokens"] == 4 * 2**20
    assert "--precision bf16 (the planning default)" in out["defaults"][0]
    odd = planned("--params", "7.5e9", "--devices", "96", "--zero", "0")
    assert odd["batch"]["global"] % 96 == 0
    assert odd["batch"]["tokens"] == pytest.approx(4 * 2**20, rel=0.05)
    given = planned(
        "--model", "tiny", "--devices", "4", "--batch", "8", "--seq-len", "64",
        "--precision", "fp32",
    )  # fmt: skip
    assert given["defaults"] == [] and given["batch"]["global"] == 8


def test_gpu_presets_set_the_hardware_and_flags_win():
    a100 = planned("--params", "7e9", "--devices", "8", "--gpu", "a100-40gb")
    assert (a100["hbm_bytes_per_device"], a100["tflops"]) == (40e9, 140.0)
    assert a100["collectives"][0]["link_gb_s"] == 240.0
    assert planned("--params", "7e9", "--devices", "8", "--gpu", "a100-40gb", "--hbm", "48")[
        "hbm_bytes_per_device"
    ] == pytest.approx(48e9)


# --- the search and the lessons' decision rules --------------------------------------------


def test_the_search_offers_only_what_the_engine_runs():
    base = setup_2b(mesh={"data": 16, "pipeline": 1, "fsdp": 1, "tensor": 1}, batch=64)
    cluster = search.Cluster(cost.Network(400e9, 50e9, 5e-6, 8), 400e12, 80e9, 3e9)
    every = list(search.candidates(base, search.Space(batch=64), cluster))
    assert any(c.setup.virtual > 1 for c in every) and any(c.setup.pipelined for c in every)
    explicit = search.candidates(base, search.Space(batch=64, interleave=False), cluster)
    assert all(c.setup.virtual == 1 for c in explicit)  # explicit runs no interleaved schedule
    fp16 = dataclasses.replace(base, precision="fp16")  # no loss scaling inside a pipeline
    assert not any(c.setup.pipelined for c in search.candidates(fp16, search.Space(64), cluster))


def test_state_that_fits_one_device_gets_ddp():
    out = planned("--params", "1e9", "--devices", "8", "--hbm", "80", "--recommend")
    assert (out["mesh_text"], out["zero"]) == ("dp=8", 0)


def test_7b_on_8_gpus_shards_state_in_the_node_without_tp():
    out = planned("--params", "7e9", "--devices", "8", "--hbm", "80", "--recommend")
    mesh = out["mesh"]
    assert mesh["tensor"] == 1 and mesh["pipeline"] == 1 and mesh["fsdp"] > 1 and out["zero"] > 0


def test_30b_on_32_gpus_keeps_tp_in_a_node_and_shards_data_parallel_across_nodes():
    out = planned("--params", "30e9", "--devices", "32", "--hbm", "80", "--recommend")
    mesh = out["mesh"]
    option_a = mesh["fsdp"] == 32 and out["zero"] == 3  # FSDP over all 32
    option_b = 1 < mesh["tensor"] <= 8 and mesh["data"] * mesh["fsdp"] * mesh["tensor"] > 8
    assert option_a or option_b, out["mesh_text"]
    assert out["overhead_ratio"] <= 0.3  # comm + bubble <= 30% of compute
    assert out["batch"]["tokens"] == 4 * 2**20 and out["fits"]
    # The realistic batch, where nothing fitted before remat and accum were searched.
    bigger = planned(
        "--params", "30e9", "--devices", "32", "--hbm", "80", "--precision", "bf16",
        "--batch", "256", "--seq-len", "4096", "--recommend",
    )  # fmt: skip
    assert bigger["fits"] and bigger["recommendation"]["fitting"] > 0


# GPT-3 175B's shape (96 layers of 96 heads, 12288 wide), as a gated Llama MLP of its size: the
# model of Megatron-LM's published layout below (--params plans a current release's shape)
GPT3_175B = (
    "--vocab-size", "32000", "--embed-dim", "12288", "--mlp-dim", "32768", "--n-layers", "96",
    "--n-heads", "96", "--n-kv-heads", "96", "--head-dim", "128",
)  # fmt: skip


def test_175b_on_1024_gpus_is_tp_in_nodes_pipeline_across_and_data_parallel_over_the_rest():
    out = planned(*GPT3_175B, "--devices", "1024", "--hbm", "80", "--recommend")
    mesh = out["mesh"]
    assert 1 < mesh["tensor"] <= 8
    assert mesh["pipeline"] > 1 and mesh["pipeline"] * mesh["fsdp"] * mesh["tensor"] > 8
    assert out["pipeline"]["bubble_share"] <= 0.10
    assert mesh["data"] * mesh["fsdp"] > 1
    # Megatron-LM's published GPT-3 175B layout (examples/gpt3/train_gpt3_175b_distributed.sh:
    # tp 8, pp 16, micro-batch 1, batch 1536 of 2048 tokens, no optimizer sharding, no
    # sequence parallelism) fits, and the search's choice at that batch without SP is at
    # least as fast; with SP it is faster still.
    batch = ("--batch", "1536", "--seq-len", "2048")
    megatron = planned(
        *GPT3_175B, "--devices", "1024", "--hbm", "80", *batch,
        "--mesh", "dp=8,pp=16,tp=8", "--zero", "0", "--pp-schedule", "1f1b", "--microbatches",
        "192",
    )  # fmt: skip
    ours = planned(
        *GPT3_175B, "--devices", "1024", "--hbm", "80", *batch, "--recommend",
        "--sequence-parallel", "false",
    )  # fmt: skip
    assert megatron["fits"] and megatron["pipeline"]["bubble_share"] < 0.08
    assert ours["step_time_s"] <= megatron["step_time_s"] <= 1.1 * ours["step_time_s"]
    with_sp = planned(*GPT3_175B, "--devices", "1024", "--hbm", "80", *batch,
                      "--recommend")  # fmt: skip
    assert with_sp["step_time_s"] <= ours["step_time_s"]


def test_the_train_command_runs_the_recommended_layout():
    out = planned(*GPT3_175B, "--devices", "1024", "--hbm", "80", "--recommend")
    command = out["recommendation"]["train_command"].split()
    assert command[:3] == ["python", "-m", "spmd.train"]
    sections = config.resolve(command[3:], resolve.sections(), "t", expand=resolve.expand_layout)
    run = config.flat_values(config.as_dict(sections))
    run = type("Flags", (), run)  # the flat flags, read as attributes
    model = sections["model"]
    # the planner's mesh names the axes it models; the others (expert) are 1
    assert parse_mesh(run.mesh) == {**dict.fromkeys(MESH_AXES, 1), **out["mesh"]}
    assert run.batch == out["batch"]["global"]
    assert (run.seq_len, run.precision, model.remat) == (4096, "bf16", out["remat"])
    pipe = out["pipeline"]
    assert (run.pp_schedule, run.pp_virtual) == (pipe["schedule"], pipe["virtual"])
    assert run.accum * run.microbatches == pipe["microbatches"]
    assert {k: getattr(model, k) for k in out["shape"]} == out["shape"]


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_pipeline_figures_match_the_tick_tables(schedule, virtual):
    for stages, microbatches in ((2, 4), (4, 4), (4, 8), (4, 16)):
        table = schedules.build(schedule, stages, microbatches, virtual, True)
        s = setup_2b(
            shape=ModelShape(**shape.release_for(1e9).fields()),  # 16 layers: 8 chunks divide
            mesh={"data": 1, "pipeline": stages, "fsdp": 1, "tensor": 1}, zero=0,
            schedule=schedule, microbatches=microbatches, virtual=virtual, batch=microbatches,
        )  # fmt: skip
        cost.check_setup(s)
        assert pipeline_figures.pipeline_ticks(s) == table.ticks
        assert pipeline_figures.stashed_inputs(s) == table.stash_slots + table.inbox_slots
        assert pipeline_figures.bubble_share(s) == table.summary()["bubble_theory"]


def test_plot_draws_memory_by_role_and_the_step_time(tmp_path):
    import matplotlib.image

    for args in (("--recommend",), ("--mesh", "fsdp=8", "--zero", "3")):
        path = tmp_path / f"plan{len(args)}.png"
        out = planned("--params", "7e9", "--devices", "8", *args, "--plot", str(path))
        assert out["plot"] == str(path)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
        pixels = matplotlib.image.imread(path)[..., :3]
        assert pixels.shape[0] >= 500 and pixels.shape[1] >= 1200
        seen = {tuple(p) for p in (pixels.reshape(-1, 3) * 255).round().astype(int).tolist()}
        for color in plot.ROLE_COLORS:  # every role's bars are drawn
            assert tuple(int(color[i : i + 2], 16) for i in (1, 3, 5)) in seen, color


def test_measure_a_recommended_layout():
    out = planned(
        "--model", "tiny", "--devices", "8", "--batch", "16", "--seq-len", "64",
        "--precision", "fp32", "--recommend", "--measure",
    )  # fmt: skip
    measured = out["measured"]
    assert measured["mesh_text"] == out["mesh_text"]
    for row in ("params", "master + optimizer state"):
        assert measured["rows"][row]["ratio"] == pytest.approx(1.0, rel=1e-3)
    comm = [row for name, row in measured["rows"].items() if name.endswith("bytes/step")]
    assert comm and all(row["ratio"] == pytest.approx(1.0, rel=0.05) for row in comm)


MOE_LAYOUTS = [("ep=4", 1), ("fsdp=4,ep=2", 3), ("fsdp=2,ep=2,tp=2", 1), ("dp=2,ep=2", 2)]


@pytest.mark.parametrize("mesh, zero", MOE_LAYOUTS)
def test_moe_plan_splits_the_experts_and_counts_the_all_to_all(mesh, zero):
    """The routed experts' params per device are total / (ep x fsdp x tp), whatever the ZeRO
    stage; the all-to-all bytes per MoE layer are theory's formula (checked against compiled
    HLO in tests/test_moe.py) and its closed form: 4 x (ep x fsdp) x peer block x embed x bytes
    plus the E int32 counts."""
    cfg = config.build(moe.MoEConfig, config.preset("moe-small"), "moe-small")
    out = planned("--model", "moe-small", "--mesh", mesh, "--zero", str(zero), "--batch", "16",
                  "--seq-len", "64", "--precision", "fp32")  # fmt: skip
    sizes = {**dict.fromkeys(MESH_AXES, 1), **parse_mesh(mesh)}
    assert out["mesh"] == sizes
    x = out["experts"]
    ways = sizes["expert"] * sizes["fsdp"] * sizes["tensor"]
    assert x["expert_params"] == cfg.n_layers * cfg.n_experts * 3 * cfg.embed_dim * cfg.mlp_dim
    assert x["expert_params_per_device"] == x["expert_params"] / ways
    assert x["expert_bytes_per_device"] == 16 * x["expert_params"] / ways  # fp32 + 2 moments
    rows = 16 // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
    # the sorted rows' padded all-to-all (models/moe_all_to_all.py): each device sends each of
    # the ep x fsdp devices a block of rows x 64 tokens x min(k, local experts) rows, 4 times,
    # and once the E int32 counts; dropless (capacity 64)
    split = sizes["expert"] * sizes["fsdp"]
    block = rows * 64 * min(cfg.experts_per_token, cfg.n_experts // split)
    closed_form = 4 * split * block * cfg.embed_dim * 4 + cfg.n_experts * 4
    expected = theory.expert_all_to_all(
        cfg.shape(), types.SimpleNamespace(shape=sizes), 16, 64, element_bytes=4
    )
    assert x["all_to_all_bytes_per_layer"] == expected["bytes_per_layer"] == closed_form
    all_to_all = [c for c in out["collectives"] if c["kind"] == "all-to-all"]
    assert [c["bytes"] for c in all_to_all] == [closed_form * cfg.n_layers]  # per step
    # Compute counts active params only: 6 x active x tokens + attention (spmd.estimate.flops).
    assert out["flops_per_step"] == pytest.approx(16 * 64 * decoder_flops_per_token(cfg, 64))


def test_a_dense_plan_has_an_expert_axis_of_one_and_no_expert_figures():
    out = planned("--model", "tiny", "--mesh", "dp=2,fsdp=2", "--batch", "8", "--seq-len", "64")
    assert out["mesh"]["expert"] == 1 and "experts" not in out
    assert "all-to-all" not in out["comm_bytes_per_step"]


@pytest.mark.parametrize(
    "mesh, zero, remat",
    [
        ("ep=4", 1, "none"),
        ("ep=4", 1, "full"),
        ("fsdp=2,ep=2", 3, "full"),
        ("dp=2,ep=2", 0, "none"),
    ],
)
def test_measure_agrees_for_moe(mesh, zero, remat):
    """--measure builds the MoE through models/moe.create: params, master + optimizer state
    and all-to-all bytes per device equal the compiled step's within 1%, the all-to-alls that
    full remat replays included; on ep=4 the all-reduces too, and nothing is all-gathered (the
    router's top-k once replicated the global batch's probabilities: all-gathers, and under
    remat 2.5x the all-reduce and 1.67x the all-to-all bytes); no collective-permutes."""
    out = planned("--model", "moe-tiny", "--mesh", mesh, "--zero", str(zero), "--batch", "8",
                  "--seq-len", "32", "--precision", "fp32", "--remat", remat,
                  "--measure")  # fmt: skip
    rows = out["measured"]["rows"]
    assert out["measured"]["n_params"] == out["n_params"]
    checked = ["params", "master + optimizer state", "all-to-all bytes/step"]
    # dp=2,ep=2 under ZeRO 0 (what the search picks at fsdp 1): the compiled step all-reduced
    # 9.3x the planned gradient bytes while the experts' weight gradients were summed over
    # `data` once per block of the grouped matmul (spmd.parallel.expert_exchange.varying)
    checked += {0: ["all-reduce bytes/step"], 1: ["all-reduce bytes/step"]}.get(zero, [])
    checked += {3: ["all-gather bytes/step"]}.get(zero, [])
    for row in checked:
        assert rows[row]["ratio"] == pytest.approx(1.0, rel=0.01), row
    # no permutes beside the all-to-alls: the experts are split in the batch's axis order
    assert rows.get("collective-permute bytes/step", {"compiled": 0})["compiled"] == 0
    if zero == 1:
        assert rows.get("all-gather bytes/step", {"compiled": 0})["compiled"] == 0


def experts_split(mesh: dict) -> int:
    """Ways a layout splits the routed experts: ep x fsdp (ZeRO 0 folds fsdp into dp)."""
    return mesh.get("expert", 1) * mesh["fsdp"]


def test_recommend_searches_ep_and_chooses_it_where_it_wins():
    """--recommend tries ep at every size dividing the experts (its all-to-alls in the step):
    moe-small fits every device whole, so DDP wins and an ep layout runs up; with fsdp held at
    1 and 50 MB of HBM (DDP needs 66 MB) the experts must split, and ep does it (dp=4,ep=2,
    the layout test_measure_agrees_for_moe compiles at moe-tiny's size as dp=2,ep=2). Each layout's
    experts per device times the split (x tp, which cuts each expert) is all the experts; the
    router losses keep pp = 1."""
    args = ("--model", "moe-small", "--devices", "8", "--batch", "16", "--seq-len", "128")
    out = planned(*args, "--recommend")
    assert out["mesh"]["pipeline"] == 1
    ups = [parse_mesh(c["mesh_text"]) for c in out["recommendation"]["runner_ups"]]
    assert any(m.get("expert", 1) > 1 for m in ups)
    held = planned(*args, "--mesh", "fsdp=1", "--hbm", "0.05", "--overhead", "0", "--recommend")
    mesh, x = held["mesh"], held["experts"]
    assert mesh["expert"] > 1 and mesh["fsdp"] == 1 and mesh["pipeline"] == 1
    for layout in (out, held):
        ways = experts_split(layout["mesh"]) * layout["mesh"]["tensor"]
        per_device = layout["experts"]["expert_params_per_device"]
        assert per_device * ways == pytest.approx(layout["experts"]["expert_params"])
    assert x["n_experts"] % mesh["expert"] == 0 and held["comm_bytes_per_step"]["all-to-all"] > 0
    assert held["comm_time_s_per_step"]["all-to-all"] <= held["exposed_comm_time_s"]


QWEN3_30B_A3B = ("--family", "qwen3_moe", "--embed-dim", "2048", "--n-layers", "48",
                 "--n-experts", "128", "--expert-mlp-dim", "768", "--experts-per-token", "8",
                 "--n-heads", "32", "--n-kv-heads", "4", "--head-dim", "128",
                 "--vocab-size", "151936", "--mlp-dim", "6144", "--qk-norm", "true",
                 "--devices", "8", "--gpu", "h100", "--seq-len", "4096")  # fmt: skip


def test_qwen3_30b_a3b_on_8_h100_splits_its_experts_by_all_to_all():
    """Qwen3-30B-A3B's shape on 8 x H100 80 GB: its 464 GB of expert state must split, tp
    stops at 4 (4 kv heads), and the padded all-to-all's bytes grow with the ways the experts
    are split (ways x the routed rows), so the fastest layouts split them 2 ways beside tp=4:
    fsdp=2 (ZeRO-1 also shards the dense params' state, micro-batch 8) and tp=4,ep=2 (which
    replicates it: micro-batch 4), within 1%; the all-to-alls are the step's largest
    communication. With fsdp held at 1 the search takes ep=2."""
    out = planned(*QWEN3_30B_A3B, "--recommend")
    mesh, rec = out["mesh"], out["recommendation"]
    assert mesh["pipeline"] == 1 and mesh["tensor"] == 4 and experts_split(mesh) == 2
    times = out["comm_time_s_per_step"]
    assert times["all-to-all"] == max(times.values())
    assert (
        out["step_time_s"] == pytest.approx(out["compute_time_s"] + out["exposed_comm_time_s"])
        and out["exposed_comm_time_s"] >= times["all-to-all"]
    )
    ep = [c for c in rec["runner_ups"] if "ep=" in c["mesh_text"]]
    assert ep and ep[0]["mesh_text"] == "tp=4,ep=2" and 0 < ep[0]["slower"] < 0.01
    held = planned(*QWEN3_30B_A3B, "--mesh", "fsdp=1", "--recommend")["mesh"]
    assert held["expert"] == 2 and held["tensor"] == 4


def test_executed_flops_count_the_attention_kernels_causal_share():
    """The planner's executed FLOPs count the scores the causal kernel computes: at 256 tokens
    XLA's 4 query chunks, 5/8 of them, and then equal the compiled step's dot FLOPs (tiny,
    one device, remat none; counting the scores whole is 1.14x over). Past one key block the
    blockwise kernel loops over each query block's key blocks with traced bounds, which the
    compiled program's trip counts do not show, so there the share is checked against the
    kernel's own key ranges: query block i runs key blocks 0 to i, 10 of 16 at 2,048 tokens."""
    cfg = config.build(llama.LlamaConfig, {**config.preset("tiny"), "remat": "none"}, "tiny")
    s = setup_2b(shape=cfg.shape(), n_params=cfg.n_params(), zero=1, batch=1, seq_len=256,
                 remat="none", mesh=dict.fromkeys(MESH_AXES, 1))  # fmt: skip
    program, _ = plan.engine_program(s, cfg, jax.devices()[:1])
    dots = hlo_dot_flops(program.compile_train_step(1, 256))
    assert timing.executed_flops(s) == pytest.approx(dots, rel=1e-3)
    skipped = 3 * timing.forward_flops_per_token(s)["attention"] * 256 * (1 - 5 / 8)
    print(f"scores counted whole: {(timing.executed_flops(s) + skipped) / dots:.3f} x the dots")
    assert (timing.executed_flops(s) + skipped) / dots > 1.1
    for seq_len in (1024, 2048, 2560):
        blocks = -(-seq_len // BLOCK_K)
        ranges = [blockwise_attention._key_range(i, jnp.int32(0), BLOCK_K, BLOCK_K, blocks)
                  for i in range(blocks)]  # fmt: skip
        visited = sum(int(end) - int(first) for first, end in ranges)
        assert long_sequence.score_share(seq_len, 1) == visited * BLOCK_K**2 / seq_len**2


def test_moe_executed_flops_match_the_compiled_dots():
    """The planner's executed FLOPs of an MoE (active params + the routing padding: every row
    of the padded all-to-all blocks a device receives, spmd.estimate.experts.exchange_rows)
    equal the compiled step's dot FLOPs within 1% (moe-tiny, ep=4, dropless: each device runs
    512 rows for its 128 tokens' 256 pairs, so model FLOPs alone are 1.58x fewer; the one-hot
    dispatch ran 1.89x)."""
    cfg = config.build(moe.MoEConfig, config.preset("moe-tiny"), "moe-tiny")
    s = setup_2b(shape=cfg.shape(), n_params=cfg.n_params(), zero=1, batch=16, seq_len=32,
                 mesh={**dict.fromkeys(MESH_AXES, 1), "expert": 4})  # fmt: skip
    program, _ = plan.engine_program(s, cfg, jax.devices()[:4])
    dots = hlo_dot_flops(program.compile_train_step(16, 32)) * s.devices
    assert timing.executed_flops(s) == pytest.approx(dots, rel=0.01)
    assert 1.5 < dots / timing.model_flops(s) < 1.7


# --- long sequences: context parallelism (cp) and sequence parallelism (SP) ------------------


def tiny_setup(mesh: str, **changes) -> cost.Setup:
    cfg = config.build(llama.LlamaConfig, config.preset("tiny"), "tiny")
    sizes = {**dict.fromkeys(MESH_AXES, 1), **parse_mesh(mesh)}
    values = dict(shape=cfg.shape(), n_params=cfg.n_params(), mesh=sizes, zero=1, precision="fp32",
                  optimizer="adamw", batch=8, seq_len=1024)  # fmt: skip
    return cost.Setup(**{**values, **changes})


def test_context_parallel_splits_activations_and_sends_theorys_ring():
    """cp=4 holds 1/4 of every token-linear activation and (cp + 1)/(2 cp²) of the attention
    probabilities (the load-balanced ring), and adds the ring's collective-permutes, the same
    figure as spmd.estimate.theory (which tests/test_context_parallel.py checks against
    compiled HLO): 2 (k, v) x (cp - 1) per layer, forward and backward, of [8, 256, 4, 8]."""
    one, cp4 = tiny_setup("dp=1"), tiny_setup("cp=4")
    ratio = memory.activation_bytes(cp4) / memory.activation_bytes(one)
    # 0.56 here; compiled temp 0.39 (docs/planning.md): one device's blockwise kernel holds one
    # block of scores, the ring at cp=4 its unmasked blocks
    assert 0.45 < ratio < 0.65
    (ring,) = [c for c in comms.collectives(cp4) if c.kind == "collective-permute"]
    layers = cp4.shape.n_layers
    assert (ring.count, ring.bytes) == (2 * 2 * 3 * layers, 8 * 256 * 4 * 8 * 4)
    model = cp4.shape
    count, nbytes = theory.ring_sends(model, types.SimpleNamespace(shape=cp4.mesh), 1, 8, 1024, 4)
    assert (count, nbytes) == (ring.count, ring.count * ring.bytes)
    (grads,) = [c for c in comms.collectives(cp4) if c.purpose == "gradients"]
    assert (grads.axes, grads.group) == (("context",), 4)  # averaged over context too
    remat = dataclasses.replace(cp4, remat="full")  # the backward replays the forward's ring
    (replayed,) = [c for c in comms.collectives(remat) if c.kind == "collective-permute"]
    assert replayed.count == ring.count * 3 // 2
    out = planned("--model", "tiny", "--mesh", "cp=4", "--batch", "8", "--seq-len", "1024",
                  "--precision", "fp32")  # fmt: skip
    x = out["long_sequence"]
    assert (x["context"], x["tokens_per_device"]) == (4, 256)
    assert x["ring_bytes_per_layer"] == ring.count * ring.bytes // layers
    assert x["activation_bytes_unsplit"] == round(memory.activation_bytes(one))


def test_sequence_parallel_moves_the_all_reduces_bytes_and_keeps_less():
    tp = tiny_setup("tp=4", batch=16, seq_len=64)
    sp = dataclasses.replace(tp, sequence_parallel=True)

    def wire(s: cost.Setup, kinds: set) -> float:
        return sum(comms.wire_bytes(c) * c.count for c in comms.collectives(s) if c.kind in kinds)

    kinds = {c.kind for c in comms.collectives(sp) if c.purpose == "activations (SP)"}
    assert kinds == {"all-gather", "reduce-scatter"}
    assert [c for c in comms.collectives(tp) if c.purpose == "activations"][0].kind == "all-reduce"
    activations = wire(sp, kinds)
    assert activations == pytest.approx(
        sum(
            comms.wire_bytes(c) * c.count
            for c in comms.collectives(tp)
            if c.purpose == "activations"
        )
    )
    # the residual stream (4 x embed per token per layer, embedding output, final norm) / tp
    saved = memory.activation_bytes(tp) - memory.activation_bytes(sp)
    assert saved == (4 * tp.shape.n_layers + 2) * 16 * 64 * tp.shape.embed_dim * 4 * 3 / 4


@pytest.mark.parametrize("extra", [(), ("--sequence-parallel", "--remat", "full")])
def test_measure_agrees_for_tensor_parallelism_under_the_auto_executor(extra):
    """tp=2 compiled by XLA:CPU under the auto executor all-reduces the planned bytes once the
    CPU's ways are counted (reduce-scatters as whole-buffer all-reduces, and 3 input-gradient
    reductions more per layer: 1.665x the textbook bytes without them); with SP its
    all-gathers equal the plan's."""
    out = planned("--model", "tiny", "--mesh", "tp=2", "--batch", "8", "--seq-len", "32",
                  "--precision", "fp32", "--measure", *extra)  # fmt: skip
    rows = out["measured"]["rows"]
    kinds = ["all-reduce", *(["all-gather"] if extra else [])]
    assert {k.split()[0] for k in rows if k.endswith("bytes/step")} == set(kinds)
    for kind in kinds:
        assert rows[f"{kind} bytes/step"]["ratio"] == pytest.approx(1.0, rel=0.01), kind
    assert any("AllReduceReassociate" in note for note in out["measured"]["notes"])


@pytest.mark.parametrize(
    "schedule, executor, extra",
    [("gpipe", "auto", ()), ("1f1b", "explicit", ("--sequence-parallel",))],
)
def test_measure_agrees_for_tensor_parallelism_inside_a_pipeline(schedule, executor, extra):
    """pp=2,tp=2: the stages run every tick of the table in lockstep, so the blocks' tensor-
    parallel collectives run once per tick (bubble ticks included) over one chunk, not once
    per micro-batch: the compiled bytes equal the plan's (2.19x and 1.50x them when the plan
    counted micro-batches)."""
    out = planned("--model", "tiny", "--mesh", "pp=2,tp=2", "--pp-schedule", schedule,
                  "--collectives", executor, "--batch", "8", "--seq-len", "32",
                  "--precision", "fp32", "--measure", *extra)  # fmt: skip
    rows = out["measured"]["rows"]
    collectives = [k for k in rows if k.endswith("bytes/step")]
    assert len(collectives) == (2 if executor == "auto" else 4)
    for row in collectives:
        assert rows[row]["ratio"] == pytest.approx(1.0, rel=0.01), row


@pytest.mark.parametrize("remat", ["none", "full"])
def test_measure_agrees_for_context_and_sequence_parallel(remat):
    """The compiled explicit step of cp=2,tp=2 with SP moves exactly the planned bytes: the
    ring's collective-permutes, SP's all-gathers and reduce-scatters, the all-reduces (grads
    over context, norm grads and the cross-entropy's sums over tensor). With remat the
    backward's replay of each layer gathers two inputs but scatters one output."""
    out = planned("--model", "tiny", "--mesh", "cp=2,tp=2", "--sequence-parallel",
                  "--collectives", "explicit", "--batch", "8", "--seq-len", "64",
                  "--precision", "fp32", "--remat", remat, "--measure")  # fmt: skip
    rows = out["measured"]["rows"]
    kinds = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce")
    assert {k.split()[0] for k in rows if k.endswith("bytes/step")} == set(kinds)
    for row in ("params", "master + optimizer state", *(f"{k} bytes/step" for k in kinds)):
        assert rows[row]["ratio"] == pytest.approx(1.0, rel=0.01), row
    assert out["sequence_parallel"] and out["measured"]["executor"] == "explicit"


def test_recommend_picks_context_parallelism_where_nothing_fits_without_it():
    # a 1B-sized model with 8 heads of 256 on a node of 16, one sequence of 131072 tokens a
    # step: the batch splits over no data-parallel axis and tp cannot split the heads more
    # than 8 ways, so only cp puts all 16 devices to work (attention's memory is linear in
    # length now, so it is no longer memory that asks for cp)
    args = ("--vocab-size", "32000", "--embed-dim", "2048", "--mlp-dim", "5376", "--n-layers",
            "16", "--n-heads", "8", "--n-kv-heads", "8", "--head-dim", "256", "--devices", "16",
            "--devices-per-node", "16", "--seq-len", "131072", "--batch", "1",
            "--recommend")  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as e:
        assert plan.main([*args, "--mesh", "cp=1", "--json"]) == 2
    assert "found no valid layout of 16 devices for --batch 1" in e.getvalue()
    out = planned(*args)
    assert out["fits"] and out["mesh"]["context"] > 1
    assert out["long_sequence"]["tokens_per_device"] == 131072 // out["mesh"]["context"]
    command = out["recommendation"]["train_command"]
    assert f"cp={out['mesh']['context']}" in command.split("--mesh ")[1].split()[0]
    assert any(line.startswith(f"cp={out['mesh']['context']}:") for line in
               out["recommendation"]["reasons"])  # fmt: skip


def test_a_state_that_fits_only_in_host_memory_is_recommended_with_offload_and_measured():
    """The tiny model over fsdp=8 (ZeRO-3, remat none held) in 1.6 MB of device memory: its
    1.77 MB do not fit, so the search's last pass keeps the optimizer state on the host
    (1.49 MB on the device), and the compiled step takes its state in those memories."""
    args = ("--model", "tiny", "--mesh", "fsdp=8", "--zero", "3", "--remat", "none",
            "--batch", "8", "--seq-len", "32", "--precision", "fp32", "--overhead", "0",
            "--hbm", "0.0016", "--recommend")  # fmt: skip
    assert not planned(*args, "--offload", "none")["fits"]
    out = planned(*args, "--measure")
    assert out["fits"] and out["offload"] == "optimizer"
    assert "--offload optimizer" in out["recommendation"]["train_command"]
    assert any(line.startswith("--offload optimizer:") for line in out["recommendation"]["reasons"])
    host = out["host"]
    assert host["state_bytes_per_device"] == out["optimizer_bytes_per_device"]
    assert out["total_bytes_per_device"] == round(
        out["model_state_bytes_per_device"] - host["state_bytes_per_device"]
        + out["activation_bytes_per_device"]
    )  # fmt: skip
    rows = out["measured"]["rows"]
    for row in ("state in device memory", "state in host memory"):
        assert rows[row]["ratio"] == pytest.approx(1.0, rel=0.05), row
    assert rows["state in host memory"]["analytic"] == host["state_bytes_per_device"]


def test_offload_costs_its_transfers_and_needs_the_hosts_memory():
    """7B (bf16) on one device: --offload optimizer takes its 12 B/param off the device, adds
    one direction's bytes over the host link to the step (PCIe runs both ways at once), and
    fits only where the node's host memory holds it; --remat offload's copies are hidden
    behind compute until they outlast it."""
    s = setup_2b(mesh={"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 1}, zero=0, batch=8)
    s = dataclasses.replace(s, precision="bf16", n_params=7e9, remat="full")
    net = cost.Network(400e9, 50e9, 0.0, 8, host_bandwidth=25e9)
    offloaded = dataclasses.replace(s, offload="optimizer")
    plain_t, offloaded_t = (timing.step_time(x, net, 400e12) for x in (s, offloaded))
    assert offloaded_t["host"] == pytest.approx(12 * 7e9 / 25e9)
    assert offloaded_t["step"] == pytest.approx(plain_t["step"] + offloaded_t["host"])
    plain_m, offloaded_m = (memory.memory(x, 3e9, 80e9, 1000e9, 8) for x in (s, offloaded))
    assert plain_m["total"] - offloaded_m["total"] == pytest.approx(12 * 7e9)
    assert offloaded_m["host"] == pytest.approx(84e9) and offloaded_m["host_fits"]
    assert not memory.memory(offloaded, 3e9, 1e12, 80e9, 8)["fits"]  # 84 GB of host in 80
    # params offload frees the params between steps only: the step's peak holds them
    params = dataclasses.replace(offloaded, zero=3, offload="params")
    assert memory.memory(params, 3e9, 80e9)["total"] == offloaded_m["total"]
    assert memory.memory(params, 3e9, 80e9)["host"] == pytest.approx(98e9)
    # --remat offload: each pass's copies behind its compute (forward 1/3, backward 2/3)
    act = dataclasses.replace(s, remat="offload")
    each_way = memory.offloaded_activation_bytes(act) * act.micro_steps
    compute = timing.step_time(act, net, 400e12)["compute"]
    for bandwidth in (1e15, each_way / compute, each_way / (2 * compute)):
        exposed = offload_model.host_time(act, bandwidth, compute)["exposed"]
        wanted = max(0, each_way / bandwidth - compute / 3) + max(
            0, each_way / bandwidth - compute * 2 / 3
        )
        assert exposed == pytest.approx(wanted)
    assert offload_model.host_time(act, 1e15, compute)["exposed"] == 0


def test_plan_refuses_what_the_engine_does_not_offload(capsys):
    for flags, named in (
        (["--zero", "1", "--offload", "params"], "--zero 3"),
        (["--mesh", "pp=2,fsdp=4", "--offload", "optimizer"], "pp > 1"),
        (["--host-bandwidth", "0", "--offload", "optimizer"], "--host-bandwidth"),
    ):
        assert plan.main(["--params", "7e9", "--devices", "8", *flags]) == 2
        assert named in capsys.readouterr().err
