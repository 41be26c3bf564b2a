"""A new user's first day (issue 45), as README.md and docs/ tell it: the default tracker from
the plain install, --help with defaults and choices, the command printed at a stop continues
the run, config.toml trains anew, `--checkpoint-dir none`, `--zero 0` in plan, train and the
library, Hugging Face round trips that keep the tokenizer and its chat template, `spmd.data`,
the report's panels and markers, `make_mesh` on a few of the devices, the docs' pip lines."""

import contextlib
import importlib
import io
import json
import re
import shlex
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import jax
import pytest

import spmd
from spmd import cli, convert, generate, plan, report, train
from spmd.errors import UsageError
from spmd.parallel.layout import Layout
from spmd.run import config, parser
from spmd.run.checks import check_choices
from spmd.training import run_folder
from tests.cli import ROOT, records

FIXTURES = ROOT / "tests" / "fixtures"
CHAT_TOKENIZER = FIXTURES / "chat_tokenizer"
# The README's commands, shrunk: the tiny preset, 2 steps of 8 windows of 16 tokens
SHRINK = ["--model", "tiny", "--mesh", "dp=2", "--batch", "8", "--seq-len", "16", "--steps", "2"]
SHRINK += ["--warmup", "1", "--eval-fraction", "0", "--log-every", "1"]


def readme_commands(prefix: str) -> list[list[str]]:
    """The README's command lines that start with `prefix`, comments and `&&` chains cut."""
    found = []
    for line in (ROOT / "README.md").read_text().splitlines():
        for part in line.split("#")[0].split("&&"):
            if part.strip().startswith(prefix):
                found.append(shlex.split(part)[len(shlex.split(prefix)) :])
    return found


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:2]
    (root / "corpus.txt").write_text("".join(p.read_text() for p in stdlib))
    return ["--data", str(root / "corpus.txt"), "--data-cache", str(root / "tokens")]


def train_main(argv: list[str], capsys) -> str:
    """Run spmd.train in-process; its stdout and stderr together (asserting exit 0)."""
    code = train.main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return out.out + out.err


# 1, 3, 8: the default run, the stop and its printed command, config.toml into a new folder


def test_default_tracker_is_a_core_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=\[ ]", d)[0].lower() for d in project["dependencies"]}
    assert "tensorboardx" in core  # what --tracker tensorboard (the default) imports


def test_readme_runs_write_what_it_says_and_continue_as_printed(
    corpus, tmp_path, monkeypatch, capsys
):
    """The quick start (shrunk, and stopped after step 1), the command its stop prints, then
    the folder's config.toml: three runs of one compiled step."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(run_folder.RUNS_ENV, str(tmp_path / "runs"))
    (quick_start,) = readme_commands("python -m spmd.train")[:1]
    assert quick_start == []  # the quick start: the command alone
    out = train_main([*quick_start, *SHRINK, *corpus, "--stop-after", "1"], capsys)
    assert "warning" not in out.lower()  # the default tracker starts from the core install
    (folder,) = (tmp_path / "runs").iterdir()
    # a stop prints the command that continues the run, which does (with --run-dir)
    command = out.split("to continue: ")[1].splitlines()[0]
    assert command == f"python -m spmd.train --config {folder}/config.toml --run-dir {folder}"
    out = train_main(shlex.split(command)[3:], capsys)
    assert f"resumed from step 1 in {folder}/checkpoints" in out and "done: 2 steps" in out
    assert "warning" not in out.lower()
    assert f"its curves: python -m spmd.report {folder}\n" in out  # (matplotlib is installed)
    # README: "its config as TOML, metrics JSONL, per-rank logs, TensorBoard events ... and
    # checkpoints"
    readme = " ".join((ROOT / "README.md").read_text().split())
    claims = {
        "its config as TOML": "config.toml",
        "metrics JSONL": "metrics.jsonl",
        "per-rank logs": "logs/rank-00000.log",
        "TensorBoard events": "tensorboard/events.out.tfevents.*",
        "and checkpoints": "checkpoints/2",
    }
    for claim, pattern in claims.items():
        assert claim in readme
        assert list(folder.glob(pattern)), f"README says {claim}; {folder} has no {pattern}"
    # config.toml, last written by a start with --run-dir, trains the run again in a new folder
    out = train_main(["--config", str(folder / "config.toml")], capsys)
    (again,) = set((tmp_path / "runs").iterdir()) - {folder}
    assert "resumed" not in out
    losses = [
        {r["step"]: r["loss"] for r in records(f / "metrics.jsonl") if r["kind"] == "train"}
        for f in (again, folder)
    ]
    assert sorted(losses[0]) == [1, 2] and losses[0] == losses[1]  # stopped + continued: same


# 4


def test_checkpoint_dir_none_means_none_without_a_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config.flat(None, run_dir="none", checkpoint_dir="none")
    opened, folder = run_folder.open_folder(cfg, "")
    assert folder is None and opened.checkpoint.checkpoint_dir == ""
    assert not (tmp_path / "none").exists()


# 2


def help_text(command: str) -> str:
    """`spmd COMMAND --help`'s text (argparse exits 0 after it; spmd.plan returns 0)."""
    module = __import__(cli.COMMANDS[command][0], fromlist=["main"])
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            code = module.main(["--help"])
        except SystemExit as e:
            code = e.code
    assert code == 0
    return out.getvalue()


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_shows_every_flags_default(command):
    text = help_text(command)
    entries = re.split(r"\n(?=  -)", text.split("options:", 1)[1])
    flags = [e for e in entries if e.lstrip().startswith("--") or e.lstrip().startswith("-n")]
    no_default = ("--config", "--print-config", "--mesh", "--devices", "--batch")
    missing = [
        e.split()[0]
        for e in flags
        if "default" not in e
        and not (command == "plan" and e.split()[0] in no_default)
        and e.split()[0] not in ("--config", "--print-config")
    ]
    assert flags or command == "completion", f"{command} --help lists no flags"
    assert not missing, f"{command} --help: no default for {missing}"


def test_help_lists_the_presets_and_the_families():
    text = help_text("train")
    assert f"--model {'|'.join(config.preset_names())}" in text
    assert "--family llama|moe|" in text
    assert "--steps INT" in text and "(default: 200)" in text


# shell completion (the "What to build")
COMPLETE = """source {script}
try() {{ COMP_WORDS=("$@"); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))
  COMPREPLY=(); _shtab_spmd spmd "${{COMP_WORDS[-1]}}" "${{COMP_WORDS[-2]}}"
  echo "${{COMPREPLY[*]}}"; }}
try spmd ''
try spmd train --
try spmd train --model ''
try spmd train --lora-ra
try spmd train --run-dir ''
try spmd report ''
"""


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash to run the completion script")
def test_bash_completes_commands_flags_presets_and_folders(tmp_path, monkeypatch):
    from spmd import completion

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert completion.main(["bash"]) == 0
    script = tmp_path / "spmd.bash"
    script.write_text(out.getvalue())
    (tmp_path / "runs").mkdir()
    (tmp_path / "m.jsonl").write_text("")
    shell = tmp_path / "try.sh"
    shell.write_text(COMPLETE.format(script=script))
    lines = subprocess.run(
        ["bash", str(shell)], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    commands, train_flags, presets, lora, folders, files = (set(line.split()) for line in lines)
    assert commands == set(cli.COMMANDS)
    own = parser.built_parser(train.main)
    assert train_flags == {f for a in own._actions for f in a.option_strings if f.startswith("--")}
    assert presets == set(config.preset_names())
    assert lora == {"--lora-rank"}
    assert folders == {"runs"} and {"runs", "m.jsonl"} <= files  # folders only for --run-dir


# 5


def test_zero_0_is_plain_ddp_in_plan_train_and_the_library(capsys):
    argv = ["--model", "tiny", "--devices", "2", "--zero", "0", "--batch", "8", "--seq-len", "16"]
    assert plan.main([*argv, "--recommend"]) == 0
    out = capsys.readouterr().out
    recommended = re.search(r"recommended: (--mesh \S+ --zero \d)", out).group(1)
    command = out.split("run it:\n")[1].split()
    assert command[:3] == ["python", "-m", "spmd.train"] and "--zero" in command
    assert recommended in " ".join(command)
    assert train.main([*command[3:], "--dry-run"]) == 0  # the planner's line, as printed
    capsys.readouterr()
    # an fsdp axis that stage 0 would only replicate: one line, exit 2, in train and library
    assert train.main(["--model", "tiny", "--mesh", "fsdp=2", "--zero", "0", "--dry-run"]) == 2
    assert "--zero 0 (plain DDP) shards nothing over fsdp" in capsys.readouterr().err
    with pytest.raises(UsageError, match=r"stage 0 .*make_mesh\('dp=2'\)"):
        Layout(spmd.make_mesh("fsdp=2"), 0)
    assert spmd.sharding_rules(0)["params"]["embed"] == ()


def test_the_finetune_docs_train_commands_pass_the_checks():
    text = (ROOT / "docs" / "finetune-1b.md").read_text().replace("\\\n", " ")
    commands = [
        shlex.split(line)[3:] for line in text.splitlines() if "python -m spmd.train " in line
    ]
    recommended = re.search(r"recommended: `([^`]*)`", text).group(1)
    commands.append(["--model", "1b", *shlex.split(recommended)])
    local = [argv for argv in commands if "--init-from-hf" not in argv]  # (those need the Hub)
    assert len(local) >= 2 and any("--zero" in argv for argv in local)
    for argv in local:
        check_choices(config.Config.of(train.resolve_sections(argv)))


# 6


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The untied Llama fixture with the chat tokenizer beside it, converted to an spmd
    checkpoint, which is then moved (and the Hugging Face folder deleted)."""
    root = tmp_path_factory.mktemp("hf")
    shutil.copytree(FIXTURES / "hf_llama_untied", root / "hf")
    for path in CHAT_TOKENIZER.iterdir():
        shutil.copy(path, root / "hf")
    argv = ["--from-hf", str(root / "hf"), "--to", str(root / "ck"), "--mesh", "dp=1"]
    assert convert.main(argv) == 0
    shutil.rmtree(root / "hf")
    return Path(shutil.move(root / "ck", root / "moved"))


def test_a_converted_checkpoint_keeps_its_tokenizer_and_chat_template(converted, capsys):
    argv = ["--checkpoint", str(converted), "--chat", "--prompt", "hi", "--max-new-tokens", "3"]
    assert generate.main([*argv, "--mesh", "dp=1"]) == 0
    # the prompt as the template renders it: bos, user, "hi", end, assistant
    cfg = generate.GenerateConfig(checkpoint=str(converted), chat=True)
    run_config = {"tokenizer": "tokenizer/tokenizer.json"}
    codec = generate.codec_for(cfg, run_config, 128)
    assert generate.encode_prompts(cfg, ["hi"], codec) == [[1, 3, 12, 13, 2, 4]]


def test_to_hf_writes_the_tokenizer_files_back(converted, tmp_path, capsys):
    out = tmp_path / "hf"
    assert (
        convert.main(["--checkpoint", str(converted), "--to-hf", str(out), "--mesh", "dp=1"]) == 0
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (CHAT_TOKENIZER / name).read_bytes(), name
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


# 7


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chats")
    with (root / "chats.jsonl").open("w") as f:
        for i in range(12):
            turns = [("user", f"what is {i} plus one?"), ("assistant", f"it is {i + 1}.")]
            messages = [{"role": role, "content": text} for role, text in turns]
            f.write(json.dumps({"messages": messages}) + "\n")
    return root


def data_command():  # spmd.data, the command (imported here: a module new with issue 45)
    return importlib.import_module("spmd.data")


def data_args(chats: Path) -> list[str]:
    return [
        "--data", str(chats / "chats.jsonl"), "--messages-field", "messages",
        "--tokenizer", str(CHAT_TOKENIZER / "tokenizer.json"),
        "--data-cache", str(chats / "tokens"), "--seq-len", "40", "--batch", "2",
    ]  # fmt: skip


def test_data_preview_marks_documents_and_what_the_loss_leaves_out(chats, capsys):
    assert data_command().main(["preview", *data_args(chats), "--windows", "2"]) == 0
    out = capsys.readouterr().out
    windows = out.split("=== window ")[1:]
    assert len(windows) == 2
    for window in windows:
        text = window.split("\n", 1)[1]
        # the template's roles and the user's turn are out of the loss, the reply is in it
        assert "¶«<s><|user|>what is " in text
        assert re.search(r"<\|assistant\|>»it is \d+\.<\|end\|>", text)


def test_data_stats_counts_each_source(chats, capsys):
    mix = f"a={chats / 'chats.jsonl'}:0.5,b={chats / 'chats.jsonl'}:0.5"
    argv = data_args(chats)
    argv[1] = mix
    assert data_command().main(["stats", *argv]) == 0
    out = capsys.readouterr().out
    assert out.count("documents: 12, longest ") == 2 and "a: " in out and "b: " in out
    share = float(re.search(r"tokens in the loss: ([\d.]+)%", out).group(1))
    assert 10 < share < 50  # the replies and their end tokens only
    assert "split across windows: " in out


def test_data_bad_input_is_one_line(chats, capsys):
    assert data_command().main(["peek", *data_args(chats)]) == 2
    assert data_command().main(["stats", "--data", str(chats / "missing.jsonl")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0] == "error: 'peek' is not an action; use preview or stats"
    assert len(errors) == 2 and "missing.jsonl" in errors[1]
    assert "data" in cli.COMMANDS


# 8


def test_report_draws_eval_lr_markers_and_a_line_per_mesh(tmp_path, capsys):
    def config_record(mesh: dict, text: str) -> dict:
        return {
            "kind": "config",
            "mesh": mesh,
            "mesh_text": text,
            "config": {"parallel": {"zero": 3}},
        }

    lines = [config_record({"data": 2}, "dp=2")]
    lines += [{"kind": "train", "step": s, "loss": 5.0 - s / 10, "lr": s * 1e-3} for s in (1, 2)]
    lines += [{"kind": "eval", "step": 2, "loss": 4.9}]
    lines += [config_record({"fsdp": 2}, "fsdp=2"), {"kind": "resume", "step": 2}]
    lines += [{"kind": "train", "step": s, "loss": 5.0 - s / 10, "lr": 2e-3} for s in (3, 4)]
    lines += [{"kind": "anomaly", "step": 4, "action": "rollback", "restored_step": 3}]
    lines += [{"kind": "eval", "step": 4, "loss": 4.7}]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("\n".join(map(json.dumps, lines)) + "\n")
    run = report.load_segments(metrics)
    assert [mesh for mesh, _ in run.segments] == ["dp=2", "fsdp=2 zero3"]
    assert run.markers == [(2, "resume"), (3, "rollback")]
    assert [p[0] for p in report.PANELS] == ["train", "eval", "train", "train", "train"]
    assert report.main([str(metrics), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "dp=2 (meshes dp=2 -> fsdp=2 zero3, 1 resume(s), 1 rollback(s))" in out


# 9


def test_make_mesh_takes_the_first_devices_it_needs():
    n = len(jax.devices())  # 8, or what an earlier command of this process started with
    assert n >= 2
    one = spmd.make_mesh("dp=1")
    assert one.devices.size == 1 and one.devices.flat[0] == jax.devices()[0]
    assert spmd.make_mesh("dp=1,tp=2").devices.size == 2
    with pytest.raises(UsageError) as error:
        spmd.make_mesh(f"dp={2 * n}")
    assert "--" not in str(error.value)
    assert f"make_mesh('dp={2 * n}') needs {2 * n} devices and has {n}" in str(error.value)


# 10


def doc_texts() -> dict[str, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "spmd").rglob("*.py"))
    return {
        str(p.relative_to(ROOT)): " ".join(p.read_text().replace("`", "").split()) for p in files
    }


EXTRAS_SPEC = re.compile(r"""["']?\.\[([^\]\s]*)\]["']?""")
SPEC = r"""["']?\.\[[^\]\s]*\]["']?"""  # ".[a,b]", '.[a]' or .[a]
PIP_COMMAND = re.compile(rf"pip install (?:-e |--editable )?(?P<spec>{SPEC})(?P<more>(?: {SPEC})*)")


def test_the_docs_pip_lines_name_existing_extras_in_a_form_pip_accepts():
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    seen = 0
    for name, text in doc_texts().items():
        commands = list(PIP_COMMAND.finditer(text))
        covered = {m.start("spec") for m in commands}
        for spec in EXTRAS_SPEC.finditer(text):
            assert spec.start() in covered, f"{name}: {spec.group()} outside a pip install line"
        for command in commands:
            seen += 1
            assert not command.group("more"), f"{name}: {command.group()}: one .[...] per line"
            named = set(EXTRAS_SPEC.match(command.group("spec")).group(1).split(","))
            if any("{" in extra for extra in named):  # a message's f-string: the tracker's name
                named = {"wandb", "mlflow", "tensorboard"}
            assert named <= extras, f"{name}: {command.group()} names no extra {named - extras}"
    assert seen >= 5
