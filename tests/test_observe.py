"""Observability: the --profile breakdown, FLOPs and MFU, TensorBoard scalars, the report,
stragglers. Two real training runs feed most checks: one process with 8 devices, and two
processes with 4 each (spmd.launch)."""

import dataclasses

import pytest

from spmd import report, train
from spmd.errors import UsageError
from spmd.estimate import flops
from spmd.observe import profile, stragglers
from tests import trainer
from tests.cli import records, train_in_process
from tests.test_multihost import train as train_processes

TINY = ("--model", "tiny", "--seq-len", "32", "--batch", "16", "--eval-every", "0")
FAKE_PEAK = 0.05  # TFLOP/s: above what a CPU reaches on the tiny model, so MFU is < 100%


@pytest.fixture(scope="module")
def dp8_run(tmp_path_factory):
    """A dp=8 run with steps 3-4 profiled, TensorBoard scalars and a fake peak."""
    out = tmp_path_factory.mktemp("dp8")
    result = train_in_process(
        *TINY,
        "--mesh", "dp=8",
        "--steps", "6",
        "--log-every", "2",
        "--eval-batches", "1",
        "--eval-at-start",
        "--profile", "3:4",
        "--profile-dir", str(out / "trace"),
        "--tensorboard", str(out / "tb"),
        "--metrics", str(out / "m.jsonl"),
        "--peak-tflops", str(FAKE_PEAK),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out, result.stdout, records(out / "m.jsonl")


def test_profile_of_dp8_names_all_reduce_with_a_share_between_0_and_1(dp8_run):
    out, stdout, lines = dp8_run
    assert "profile of steps 3-4" in stdout and "all-reduce" in stdout
    assert list((out / "trace").glob("plugins/profile/*/*.xplane.pb"))  # TensorBoard reads it
    (prof,) = [r for r in lines if r["kind"] == "profile"]
    assert prof["step"] == 4 and prof["first_step"] == 3
    assert sorted(prof["devices"], key=int) == [str(i) for i in range(8)]
    for row in prof["devices"].values():
        assert row["all-reduce"] > 0 and row["compute"] > 0
        assert row["all-gather"] == row["reduce-scatter"] == 0  # DDP has only the all-reduce
        parts = row["compute"] + row["idle"] + sum(row[k] for k in profile.hlo.KINDS)
        assert parts == pytest.approx(row["step"])
        assert 0 < row["comm_fraction"] < 1
        assert row["comm_fraction"] == pytest.approx(row["all-reduce"] / row["step"])
    assert 0 < prof["comm_fraction"] < 1


def test_eval_at_start_logs_the_untrained_loss_at_step_0(dp8_run):
    _, stdout, lines = dp8_run
    evals = [r for r in lines if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 6]
    assert "eval at step 0: loss" in stdout
    # random init over 256 byte tokens starts near ln 256 = 5.55, and 6 steps lower it
    assert abs(evals[0]["loss"] - 5.545) < 0.3 and evals[1]["loss"] < evals[0]["loss"]


def test_mfu_with_a_fake_peak_is_achieved_over_peak(dp8_run):
    _, stdout, lines = dp8_run
    config = lines[0]
    assert config["peak_tflops_per_device"] == FAKE_PEAK
    model = trainer.tiny_config()
    assert config["flops_per_step"] == flops.decoder_flops_per_token(model, 32) * 16 * 32
    train = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    for r in train:
        achieved = config["flops_per_step"] / 8 / r["step_time_s"] / 1e12
        assert r["tflops_per_device"] == pytest.approx(achieved)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / FAKE_PEAK)
        assert 0 < r["mfu"] <= 1
        assert r["memory_bytes_in_use"] is None  # XLA:CPU keeps no allocator statistics
        assert r["process_step_time_s"] == [r["step_time_s"]] and r["stragglers"] == []
    assert "MFU" in stdout


def test_tensorboard_event_file_holds_the_scalars(dp8_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, lines = dp8_run
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    wanted = {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops_per_device", "mfu"}
    assert {f"train/{k}" for k in wanted} <= tags
    assert {"eval/loss", "profile/comm_fraction"} <= tags
    train = [r for r in lines if r["kind"] == "train"]
    losses = events.Scalars("train/loss")
    assert [s.step for s in losses] == [r["step"] for r in train]
    assert [s.value for s in losses] == pytest.approx([r["loss"] for r in train], rel=1e-6)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """2 real processes x 4 devices (spmd.launch), dp=8, any process above the median named."""
    tmp = tmp_path_factory.mktemp("two-processes")
    train_processes(tmp, "stragglers", 2, "--mesh", "dp=8", "--straggler-threshold", "0")
    return tmp / "stragglers.jsonl"


def test_two_processes_gather_step_times_and_name_the_slower(two_process_run):
    train_records = [r for r in records(two_process_run) if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    for r in train_records:
        times = r["process_step_time_s"]
        assert len(times) == 2 and min(times) > 0
        assert times[0] == pytest.approx(r["step_time_s"], rel=1e-6)  # process 0 writes
        assert r["stragglers"] == [times.index(max(times))]  # threshold 0: the slower one


def test_report_renders_a_png_from_two_runs(dp8_run, two_process_run, tmp_path, capsys):
    from matplotlib import image

    png = tmp_path / "report.png"
    assert report.main([str(dp8_run[0] / "m.jsonl"), str(two_process_run), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = image.imread(png).shape
    assert width > 1000 and height > 300
    # both runs are dp=8: the legend tells them apart by file name
    assert "2 run(s): dp=8 (m), dp=8 (stragglers)" in capsys.readouterr().out
    assert report.load_run(two_process_run)[0] == "dp=8"


def test_report_refuses_a_file_that_is_not_metrics(tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"kind": "summary"}\n')
    assert report.main([str(bad), "--out", str(tmp_path / "r.png")]) == 2
    assert "no config and train records" in capsys.readouterr().err


def test_compiled_dot_flops_match_the_model_formula():
    """The formula (6 N tokens + attention) plus the backward pass's recomputed attention
    scores equals the partitioned HLO's matmul FLOPs summed over devices, loops included;
    XLA's cost analysis counts the scanned body once and so falls short."""
    cfg = trainer.tiny_config()
    tokens = trainer.BATCH * trainer.SEQ_LEN
    model = flops.decoder_flops_per_token(cfg, trainer.SEQ_LEN) * tokens
    scores = 2 * cfg.n_layers * trainer.SEQ_LEN * cfg.n_heads * cfg.head_dim * tokens
    lay = trainer.layout("dp=2,tp=4")
    compiled = trainer.program(lay).compile_train_step(trainer.BATCH, trainer.SEQ_LEN)
    assert flops.hlo_dot_flops(compiled) * 8 == pytest.approx(model + scores, rel=1e-3)
    assert flops.cost_analysis_flops(compiled) * 8 < 0.5 * model
    assert profile.module_name(compiled) == "jit_train_step"


def test_peak_table_and_mfu():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert flops.peak_tflops("NVIDIA H100 PCIe", "fp16") == 756.0
    assert flops.peak_tflops("NVIDIA H200", "fp32") == 494.7
    assert flops.peak_tflops("NVIDIA A100-SXM4-40GB", "bf16") == 312.0
    assert flops.peak_tflops("TPU v5 lite", "bf16") == 197.0
    assert flops.peak_tflops("TPU v5", "bf16") == 459.0
    assert flops.peak_tflops("cpu", "fp32") is None  # unknown: no MFU rather than a wrong one
    assert flops.peak_tflops("cpu", "fp32", override=2.0) == 2.0
    assert flops.mfu(1.0, None, "x") is None
    assert flops.mfu(123.7, 989.4, "x") == pytest.approx(123.7 / 989.4)
    with pytest.raises(UsageError, match="--peak-tflops 1 TFLOP/s is below the achieved 3"):
        flops.mfu(3.0, 1.0, "--peak-tflops")
    assert flops.achieved_tflops(8e12, 8, 0.5) == pytest.approx(2.0)


def test_op_categories_and_the_sweep():
    assert profile.op_category("all-reduce.58") == "all-reduce"
    assert profile.op_category("all-gather-start.3") == "all-gather"
    assert profile.op_category("collective-permute-done") == "collective-permute"
    assert profile.op_category("reduce-scatter.1") == "reduce-scatter"
    assert profile.op_category("ragged-all-to-all.2") == "all-to-all"
    assert profile.op_category("while.89") == "control"
    assert profile.op_category("all-reduce_fusion.1") == "compute"
    assert profile.op_category("ynn_fusion") == "compute"

    def ev(device: str, start_ms: float, end_ms: float, op: str) -> profile.OpEvent:
        return profile.OpEvent(device, start_ms * 1e6, end_ms * 1e6, op, "jit_train_step")

    events = [
        ev("0", 0, 10, "while.1"),  # control flow spans its body: neither compute nor comm
        ev("0", 0, 4, "fusion.1"),
        ev("0", 2, 6, "all-reduce.1"),  # 2-4 hidden behind compute, 4-6 exposed
        ev("0", 5, 7, "all-gather.1"),  # 5-6 shared with the all-reduce, 6-7 alone
        ev("0", 9, 10, "fusion.2"),  # 7-9 idle
        ev("1", 0, 2, "fusion.1"),
        ev("1", 0, 1, "fusion.1"),
        profile.OpEvent("1", 0, 5e6, "fusion.9", "jit_eval_step"),  # another module
    ]
    table = profile.breakdown(events, "jit_train_step", steps=2)
    row = table["0"]
    assert row["compute"] == pytest.approx(5e-3 / 2)
    assert row["all-reduce"] == pytest.approx(1.5e-3 / 2)
    assert row["all-gather"] == pytest.approx(1.5e-3 / 2)
    assert row["idle"] == pytest.approx(2e-3 / 2)
    assert row["step"] == pytest.approx(5e-3) and row["comm_fraction"] == pytest.approx(0.3)
    # exposed: the kinds' 3 ms; hidden: the all-reduce's 2-4 beside compute (not in the step)
    assert row["exposed_comm"] == pytest.approx(3e-3 / 2)
    assert row["hidden_comm"] == pytest.approx(2e-3 / 2)
    assert table["1"]["step"] == pytest.approx(1e-3) and table["1"]["comm_fraction"] == 0
    assert table["1"]["hidden_comm"] == 0
    text = profile.format_breakdown(table)
    assert "all-reduce" in text and "30.0%" in text and text.splitlines()[-1].startswith("mean")
    assert "exposed" in text.splitlines()[1] and "hidden" in text.splitlines()[1]


def test_profile_window_must_lie_within_the_run():
    assert profile.parse_window("3:5", 10) == (3, 5)
    for bad in ("5:3", "0:2", "3:11", "3", "a:b"):
        with pytest.raises(UsageError, match="START:STOP"):
            profile.parse_window(bad, 10)


def test_stragglers_are_named_against_the_median():
    assert stragglers.find_stragglers([1.0], 0.2) == []
    assert stragglers.find_stragglers([1.0, 1.05, 0.98, 1.01], 0.2) == []
    assert stragglers.find_stragglers([1.0, 1.3, 0.98, 1.01], 0.2) == [1]
    assert stragglers.find_stragglers([2.0, 1.0, 1.0, 1.0, 3.0], 0.5) == [0, 4]
    line = stragglers.describe([1.0, 1.5, 1.0], [1])
    assert line == "straggler: process 1 at 1500.0 ms/step (+50.0%) vs the median 1000.0 ms/step"
    assert stragglers.gather_step_times(0.25) == [0.25]  # one process: nothing to gather


@pytest.mark.parametrize(
    "args, message",
    [
        (("--profile", "4:2"), "--profile '4:2' must be START:STOP"),
        (("--peak-tflops", "-1"), "--peak-tflops -1.0 must be 0"),
        (("--comm-warn", "1.5"), "--comm-warn 1.5 must be a fraction"),
    ],
)
def test_bad_observability_flags_exit_2(args, message, capsys):
    assert train.main([*TINY, "--steps", "5", *args]) == 2  # refused before any device work
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {message}")


def test_decoder_flops_count_matmul_params_once_whether_tied_or_not():
    cfg = trainer.tiny_config()
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    assert flops.decoder_flops_per_token(cfg, 32) == flops.decoder_flops_per_token(tied, 32)
