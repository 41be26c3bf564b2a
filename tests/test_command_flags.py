"""Every command's flags from one place: the model section's flags are the registered
families' fields (a family registered later has its flags with no edit in spmd/), each field
has one default across the commands (or a per-command default this file states), and the
resolver says which fields the user gave. Nothing is compiled."""

import dataclasses
import importlib
import typing

import pytest

from models import family, llama
from spmd import sections
from spmd.errors import UsageError
from spmd.run import config, resolve
from spmd.run.section_views import field_help, model_section

# The commands' own defaults of fields spmd.sections defines: the one list of them. Every
# other field a command takes has its section's default.
PER_COMMAND_DEFAULTS = {
    # params sharded over every device on the way: the least memory per device
    "convert": {"mesh": "fsdp=-1"},
    # a pretraining-sized step; batch 0 is "about --tokens-per-step tokens"; every device on
    # fsdp (on dp with --zero 0 and no --mesh, which spmd.plan applies after resolving)
    "plan": {"precision": "bf16", "seq_len": 4096, "batch": 0, "mesh": "fsdp=-1"},
    # a small model and few timed steps per layout and executor, on 8 simulated CPU devices
    "bench_collectives": {"model": "tiny", "steps": 30, "batch": 16, "seq_len": 128, "devices": 8},
}
# What each command needs on its command line to reach its resolver.
ARGV = {"launch": ["--", "true"], "report": ["m.jsonl"], "checkpoint": ["verify", "d"]}
COMMANDS = "train plan bench bench_collectives generate convert launch report checkpoint".split()


@dataclasses.dataclass(frozen=True)
class ToyConfig(llama.LlamaConfig):
    """A family registered after spmd/ was written."""

    family: str = "toy"
    # the toy family's own knob, in tokens: proves a new field becomes a flag with this help
    toy_window: int = 0
    remat: typing.Literal["none", "dots_saveable", "full", "offload", "toy_policy"] = "none"


@pytest.fixture
def toy_family(monkeypatch):
    toy = dataclasses.replace(family.FAMILIES["llama"], name="toy", config=ToyConfig)
    monkeypatch.setattr(family, "FAMILIES", {**family.FAMILIES, "toy": toy})
    return toy


def test_a_family_registered_later_gets_its_flags(toy_family, capsys, tmp_path):
    section = model_section()
    assert {"toy_window", "n_experts", "rope_theta"} <= {
        f.name for f in dataclasses.fields(section)
    }
    assert field_help(section)["toy_window"].startswith("the toy family's own knob")
    assert "toy_policy" in sections.literal_choices(typing.get_type_hints(section)["remat"])
    with pytest.raises(SystemExit):
        config.resolve(["--help"], resolve.sections(), "t")
    text = " ".join(capsys.readouterr().out.split())
    assert "--toy-window INT the toy family's own knob" in text
    assert "--family " + "|".join(family.FAMILIES) in text and "|toy" in text

    resolved = config.resolve(
        ["--model", "tiny", "--family", "toy", "--toy-window", "8"], resolve.sections(), "t"
    )
    assert type(resolved["model"]) is ToyConfig and resolved["model"].toy_window == 8
    assert resolved["model"].n_layers == config.preset("tiny")["n_layers"]  # under the toy family
    with pytest.raises(UsageError, match="toy_window is a field of the toy family.*--family toy"):
        config.resolve(["--model", "tiny", "--toy-window", "8"], resolve.sections(), "t")


def test_the_model_flags_are_every_family_field_with_its_help():
    section = model_section()
    names = {f.name for f in dataclasses.fields(section)}
    for fam in family.FAMILIES.values():
        assert {f.name for f in dataclasses.fields(fam.config)} <= names, fam.name
    helps = field_help(section)
    assert not [name for name in names if not helps.get(name)]
    assert helps["n_experts"] == field_help(family.get("moe").config)["n_experts"]


def _parsed(monkeypatch, command: str) -> dict:
    """What `command`'s own config.resolve call returns for its minimal command line."""
    seen = []

    class Resolved(BaseException):  # past a command's `except Exception` (bench reports those)
        pass

    real = config.resolve

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        raise Resolved

    monkeypatch.setattr(config, "resolve", spy)
    module = importlib.import_module(f"spmd.{command}")
    with pytest.raises(Resolved):
        module.main(ARGV.get(command, []))
    return seen[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_parses_the_sections_defaults(monkeypatch, command):
    canonical = {
        f.name: (f.default, typing.get_type_hints(cls)[f.name])
        for cls in [*sections.SECTIONS.values(), sections.MeshConfig]
        for f in dataclasses.fields(cls)
    }
    own = PER_COMMAND_DEFAULTS.get(command, {})
    parsed = _parsed(monkeypatch, command)
    assert parsed["given"] == set()  # no field on these command lines
    seen = set()
    for name, section in parsed.items():
        if name == "model" or not dataclasses.is_dataclass(section):
            continue
        hints = typing.get_type_hints(type(section))
        for field in dataclasses.fields(section):
            if field.name in canonical:
                default, kind = canonical[field.name]
                assert hints[field.name] == kind, (command, field.name)
                value = getattr(section, field.name)
                assert value == own.get(field.name, default), (command, field.name)
                seen.add(field.name)
    assert set(own) <= seen  # a per-command default is of a field the command takes
    module = importlib.import_module(f"spmd.{command}")
    declared = getattr(module, "DEFAULTS", None)
    if command == "plan":
        from spmd.run import plan_flags

        declared = plan_flags.DEFAULTS
    assert (declared or {}) == own


def test_resolve_says_which_fields_were_given(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text("[optimizer]\nlr = 0.01\n[model]\nn_layers = 3\n")
    argv = ["--config", str(file), "--model", "tiny", "--layout", "zero2", "--remat", "full"]
    resolved = config.resolve(argv, resolve.sections(), "t", expand=resolve.expand_layout)
    # flags, file keys, and what --layout implies; not the preset's fields, nor defaults
    assert resolved["given"] == {"lr", "n_layers", "model", "layout", "remat", "mesh", "zero"}
    assert resolved["model"].embed_dim == 64 and resolved["parallel"].zero == 2
    with_default = config.resolve(
        ["--model", "tiny"], resolve.sections(), "t", defaults={"lr": 1.0}
    )
    assert with_default["optimizer"].lr == 1.0 and with_default["given"] == {"model"}
