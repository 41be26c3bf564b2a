"""The command line end to end: training and dry runs in subprocesses, and every user error
(in-process, and two through a real process)."""

import contextlib
import importlib
import itertools
import re
import typing

import pytest

from tests.cli import records, run, train_in_process

TINY = ("--model", "tiny", "--seq-len", "32", "--batch", "16")


def test_loss_falls_on_the_stdlib_corpus(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = train_in_process(
        *TINY,
        "--mesh",
        "dp=2",
        "--steps",
        "60",
        "--warmup",
        "5",
        "--log-every",
        "10",
        "--eval-every",
        "30",
        "--metrics",
        str(metrics),
    )
    assert result.returncode == 0, result.stderr
    assert "mesh dp=2 (2 x cpu)" in result.stdout
    # the config: what differs from the defaults, a line a section, not the whole TOML
    echo = result.stdout.split("config, what differs from the defaults")[1].split("\nxla flags")[0]
    assert '\n[run] model = "tiny", steps = 60' in echo and "vocab_size" not in echo, echo
    lines = records(metrics)
    assert lines[0]["kind"] == "config" and lines[0]["mesh"]["data"] == 2
    train = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]
    assert set(train[0]) >= {"loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"}
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    evals = [r for r in lines if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [30, 60] and evals[1]["loss"] < evals[0]["loss"]
    assert lines[-1]["kind"] == "summary" and lines[-1]["steps"] == 60


def test_default_model_runs_on_dp8_tp8_with_64_simulated_devices():
    result = run(
        "spmd.train",
        "--mesh",
        "dp=8,tp=8",
        "--steps",
        "2",
        "--batch",
        "8",
        "--seq-len",
        "16",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
    )
    assert result.returncode == 0, result.stderr
    assert "simulating 64 CPU devices" in result.stderr
    assert "mesh dp=8,tp=8 (64 x cpu)" in result.stdout
    assert "step 2/2" in result.stdout


def test_dry_run_reports_memory_and_collectives():
    result = run("spmd.train", *TINY, "--mesh", "fsdp=4", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "optimizer state" in result.stdout
    assert "all-gather" in result.stdout and "fsdp" in result.stdout
    assert "step 1/" not in result.stdout


ERRORS = [
    (("--mesh", "dp=3", "--devices", "8"), "multiply to 3 but there are 8 devices"),
    (("--mesh", "dp=2,tp=-1,fsdp=-1"), "only one axis may be -1"),
    (("--mesh", "xp=2"), "'xp=2' is not AXIS=SIZE"),
    (("--mesh", "tp=4", "--n-heads", "12", "--n-kv-heads", "3"), "does not divide kv_heads=3"),
    (("--mesh", "tp=4", "--mlp-dim", "250"), "does not divide mlp=250"),
    (("--mesh", "tp=4", "--vocab-size", "258"), "does not divide vocab=258"),
    (("--mesh", "fsdp=8", "--embed-dim", "60"), "does not divide embed=60"),
    (("--mesh", "dp=8", "--batch", "12"), "--batch 12 is not divisible by data-parallel size 8"),
    (("--mesh", "dp=4", "--batch", "8", "--accum", "4"), "data-parallel size 4 x accum 4 = 16"),
    (("--model", "huge"), "--model 'huge' is not a preset; choose one of"),
    (("--layout", "zero9"), "--layout 'zero9' is not a layout"),
    (("--zero", "4", "--mesh", "fsdp=2"), "--zero 4 is not a ZeRO stage"),
    (("--bogus", "1"), "unknown flag --bogus"),
    (("--stepz", "3"), "did you mean --steps?"),
    (("--steps", "ten"), "invalid int value: 'ten'"),
    (("--vocab-size", "100"), "--vocab-size 100 is too small for the data"),
    (("--lr", "nan"), "--lr nan must be a positive, finite learning rate"),
    (("--lr", "-1"), "--lr -1 must be a positive, finite learning rate"),
    (("--beta2", "1.5"), "--beta2 1.5 must be a decay rate in [0, 1)"),
    (("--grad-clip", "-1"), "--grad-clip -1 must be a positive norm, or 0 (off)"),
]


@pytest.mark.parametrize("args,message", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_user_errors_exit_2_with_one_clear_line(args, message, capsys):
    """In-process (`python -m spmd.train` calls this `main`), on the session's 8 devices: the
    mesh checks run. The process boundary is the next test's."""
    from spmd import train

    capsys.readouterr()
    try:
        status = train.main(["--model", "tiny", "--dry-run", *args])
    except SystemExit as exited:  # the argument parser's errors
        status = exited.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # the error (and at most a notice)


# one error the mesh finds, one the argument parser finds
THROUGH_A_PROCESS = [ERRORS[0], (("--stepz", "3"), "did you mean --steps?")]


@pytest.mark.parametrize("args,message", THROUGH_A_PROCESS, ids=["mesh", "parser"])
def test_user_errors_end_the_process_with_status_2(args, message):
    result = run("spmd.train", "--model", "tiny", "--dry-run", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2


def test_the_spmd_command_dispatches_to_each_module(capsys):
    """`spmd COMMAND` is `python -m spmd.COMMAND` (in-process: the console script's function)."""
    from spmd import cli

    assert cli.main([]) == 2 and "usage: spmd COMMAND" in capsys.readouterr().out
    assert cli.main(["trian"]) == 2
    assert "'trian' is not an spmd command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # report's own parser: the files are missing
        cli.main(["report", "--out", "x.png"])
    assert exited.value.code == 2 and "required: metrics" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, table, message",
    [
        ("convert", 'from_hf = "a"\nto = "b"\nmax_shard_mb = 0', "--max-shard-mb 0 must be at"),
        ("generate", 'checkpoint = "a"\nnum_samples = 0\nprompt = "x"', "--num-samples 0 must"),
        ("launch", "num_processes = 0", "-n 0 must be a positive number"),
    ],
)
def test_config_files_reach_every_command(tmp_path, capsys, command, table, message):
    """`--config` is listed in every command's --help, and every command reads it."""
    import importlib

    path = tmp_path / "c.toml"
    path.write_text(f"[{command}]\n{table}\n")
    extra = ["--", "true"] if command == "launch" else []
    assert importlib.import_module(f"spmd.{command}").main(["--config", str(path), *extra]) == 2
    assert message in capsys.readouterr().err


COMMANDS = [
    "train",
    "plan",
    "bench",
    "bench_collectives",
    "generate",
    "convert",
    "launch",
    "report",
]


def help_entries(text: str) -> dict[str, str]:
    """{flag or positional: its help text} of an argparse --help page: an entry's help follows
    its name and metavar after two spaces or more, or on the more indented lines below."""
    lines, entries, heading = text.splitlines(), {}, ""
    for i, line in enumerate(lines):
        if line and not line.startswith(" "):
            heading = line
        entry = re.match(r"^  (-{1,2}[\w-]+|\w[\w-]*)", line)
        if not entry or not (line.startswith("  -") or heading.startswith("positional")):
            continue
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        more = itertools.takewhile(lambda x: re.match(r"^ {4,}\S", x), lines[i + 1 :])
        entries[entry.group(1)] = " ".join([*parts[1:], *(x.strip() for x in more)])
    return entries


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_command_has_a_help_text(command, capsys):
    module = importlib.import_module(f"spmd.{command}")
    with contextlib.suppress(SystemExit):  # argparse exits 0 after --help; spmd.plan returns
        assert module.main(["--help"]) == 0
    entries = help_entries(capsys.readouterr().out)
    assert len(entries) > 3 and "--config" in entries
    assert not [flag for flag, text in entries.items() if not text], entries


def test_choice_flags_list_their_choices_in_help(capsys):
    from spmd import train
    from spmd.run import config, resolve
    from spmd.sections import literal_choices

    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    hints = [typing.get_type_hints(cls) for cls in resolve.sections().values()]
    listed = {f: literal_choices(k) for h in hints for f, k in h.items() if literal_choices(k)}
    assert {"precision", "lr_schedule", "resume", "remat", "on_divergence"} <= set(listed)
    for field, choices in listed.items():
        flag, shown = config.flag_name(field), "|".join(c or '""' for c in choices)
        assert f"{flag} {shown}" in text or f"{flag} [{shown}]" in text, field
    assert "--resume [auto|required|fresh]" in text  # alone, it means required
