"""A run's whole config: its sections (spmd.sections and the model family's), resolved from
dataclass defaults, TOML presets and files, and command-line flags.

A run resolves, lowest precedence first:

    dataclass defaults < the model preset (configs/NAME.toml [model]) < --config FILE < flags

Every field of every section is a flag: `seq_len` is `--seq-len`. Field names are unique across
sections, so flags need no section prefix. A TOML file has a table per section ([run],
[optimizer], [parallel], ...); a flat [train] table is read too, each key going to the section
that owns it. `Config` is for the commands: the core packages take single sections.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.resources
import json
import os
import stat
import tomllib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from spmd.errors import UsageError
from spmd.run.parser import Parser
from spmd.run.section_views import field_help
from spmd.sections import (  # noqa: F401 (Config, flag_name, flat_values: read from here too)
    BARE_FLAG_VALUES,
    FORMER_VALUES,
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    DivergenceConfig,
    ObserveConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    flag_name,
    flat_values,
    literal_choices,
)

if TYPE_CHECKING:
    from models.contract import ModelConfig

# The table name older config files and checkpoints use for every non-model field at once.
FLAT_TABLE = "train"
TOML_LIMIT_BYTES = 1 << 20  # the longest --config read: a run's whole config is about 4 KiB


def sections_from_flat(values: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """spmd.sections' sections made from flat field values (`{"lr": 1e-3, "mesh": "dp=2"}`),
    each field going to the section that owns it; defaults elsewhere. UsageError for a key
    no section owns."""
    owner = field_owners(SECTIONS)
    by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        if key not in owner:
            near = difflib.get_close_matches(key, list(owner), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise UsageError(f"{source}: unknown key {key!r}{hint}")
        by_section[owner[key]][key] = value
    return {name: build(SECTIONS[name], by_section[name], source) for name in SECTIONS}


def flat(model_cfg: ModelConfig | None = None, /, **values: Any) -> Config:
    """A Config from the model section and flat field values, e.g. `flat(model_cfg, steps=20,
    lr=1e-3, mesh="dp=2")`: the short way to write a run in tests and scripts."""
    return Config(model=model_cfg, **sections_from_flat(values))


def field_owners(sections: dict[str, type]) -> dict[str, str]:
    """{field name: the section that owns it}."""
    return {field: name for name, cls in sections.items() for field in _field_types(cls)}


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def _field_types(cls: type) -> dict[str, Any]:
    """{field: its type}, a field that names a registry's entry typed as the `Literal` of the
    registry's names (`registry_choices`), so that --help lists them and the resolver checks
    flags and files against them."""
    hints = typing.get_type_hints(cls)
    types: dict[str, Any] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    for name in types.keys() & REGISTRY_FIELDS:
        types[name] = Literal[registry_choices(name)]  # type: ignore[valid-type]
    return types


# Fields whose value names an entry of a registry: spmd.sections, the bottom of the package
# order, types them `str` and cannot import the registries, which live in the engine.
REGISTRY_FIELDS = {"optimizer", "objective"}


def registry_choices(field: str) -> tuple[str, ...]:
    """The names field `field` may take: the entries of its registry, in their order
    (spmd.engine.optimizers for --optimizer, spmd.engine.objectives for --objective)."""
    if field == "optimizer":
        from spmd.engine import optimizers  # (optax and jax: only for the sections holding it)

        return tuple(optimizers.OPTIMIZERS)
    from spmd.engine import objectives  # (no jax: every command's [run] section holds it)

    return tuple(objectives.OBJECTIVES)


def build_parser(
    prog: str,
    sections: dict[str, type],
    description: str = "",
    short: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
    show_defaults: bool = True,
) -> Parser:
    """A parser with --config plus one flag per field of every section (default: not given),
    each with its field's help (`field_help`) and, with `show_defaults`, its default (the
    command's own `defaults`, {field: value}, over the section's); `short` adds short forms
    ({field: "-n"}). A flag's choices show as its metavar (a `Literal`'s values; the presets
    for --model)."""
    parser = Parser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument(
        "--config", help=f"TOML file with a table per section: [{'], ['.join(sections)}]"
    )
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        helps = field_help(cls)
        for name, kind in _field_types(cls).items():
            text = helps.get(name, "")
            if show_defaults and section == "model":  # the preset's value, whichever it is
                text += " (default: the --model preset's)"
            elif show_defaults:
                text += _default_text(cls, name, defaults or {})
            text = text.replace("%", "%%")  # argparse formats help with %
            names = [flag_name(name), *([short[name]] if short and name in short else [])]
            takes = _takes(name, kind)
            if name == "model" and kind is str:  # the run's preset: list the shipped ones
                takes["metavar"] = "|".join(preset_names())
            group.add_argument(*names, dest=name, default=argparse.SUPPRESS, help=text, **takes)
    return parser


def _default_text(cls: type, name: str, defaults: dict[str, Any]) -> str:
    """ " (default: VALUE)" for field `name` of section `cls`: the command's own default, else
    the field's; "" for a field without one."""
    if name in defaults:
        value = defaults[name]
    else:
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        if field.default is dataclasses.MISSING:
            return ""
        value = field.default
    shown = toml_value(value, name) if isinstance(value, str) and not value else value
    if isinstance(value, bool):
        shown = str(value).lower()
    return f" (default: {shown})"


def _takes(name: str, kind: Any) -> dict[str, Any]:
    """What flag `name` of type `kind` takes, as argparse's keywords: a bool `true` or `false`,
    or nothing for true (`--dry-run`); a value of a `Literal[...]`, which --help lists (the
    resolver's `build` checks it, for files too); a value of the field's type. A field with a
    meaning of its own alone (`--resume`) takes its value optionally."""
    if kind is bool:
        return {"type": _parse_bool, "nargs": "?", "const": True, "metavar": "BOOL"}
    choices = literal_choices(kind)
    takes = {
        "type": type(choices[0]) if choices else kind,
        "metavar": "|".join(map(_shown, choices)) if choices else kind.__name__.upper(),
    }
    if name in BARE_FLAG_VALUES:
        takes.update(nargs="?", const=BARE_FLAG_VALUES[name])
    return takes


def _shown(choice: Any) -> str:
    return str(choice) if choice != "" else '""'


def preset_names() -> list[str]:
    """The shipped presets (configs/<name>.toml), sorted."""
    return sorted(
        p.name[: -len(".toml")] for p in _configs_dir().iterdir() if p.name.endswith(".toml")
    )


def preset(name: str, section: str = "model") -> dict[str, Any]:
    """The `[section]` table of the shipped preset configs/<name>.toml."""
    available = preset_names()
    if name not in available:
        raise UsageError(f"--model {name!r} is not a preset; choose one of {', '.join(available)}")
    return load_toml(_configs_dir().joinpath(f"{name}.toml")).get(section, {})


def _configs_dir() -> Any:
    return importlib.resources.files("configs")


def load_toml(path: Any) -> dict[str, Any]:
    """Read a TOML file (or pipe) of at most TOML_LIMIT_BYTES; UsageError if it is missing,
    unreadable, a device (`/dev/zero` would be read for ever), too long, not UTF-8 or
    malformed."""
    try:
        with Path(str(path)).open("rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                raise UsageError(f"--config {path} is a device, not a file; give a TOML file")
            text = f.read(TOML_LIMIT_BYTES + 1)
        if len(text) > TOML_LIMIT_BYTES:
            raise UsageError(
                f"--config {path} is longer than {TOML_LIMIT_BYTES // 2**20} MiB, the most a "
                f"config file may hold; give the run's TOML config"
            )
        return tomllib.loads(text.decode())
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except OSError as e:  # a folder, no permission, ...
        raise UsageError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8; tomllib lets the decoder's error through
        raise UsageError(
            f"--config {path}: not a UTF-8 TOML file (byte {e.start} is not UTF-8 text)"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML ({e})") from None


def build(cls: type, values: dict[str, Any], source: str) -> Any:
    """Instantiate dataclass `cls` from `values`, naming unknown keys, bad types, gaps."""
    types = _field_types(cls)
    values = check_values(cls, values, source)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in values and f.default is dataclasses.MISSING
    ]
    if missing:
        raise UsageError(f"{source}: missing {', '.join(missing)}")
    return cls(**{k: (float(v) if types[k] is float else v) for k, v in values.items()})


# Every integer field is read by numpy, JAX or the OS as a signed 64-bit integer at most.
INT64 = (-(2**63), 2**63)


def check_values(cls: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` (in their current meaning, `_current_value`) once each key is a field of `cls`
    and each value of its type: a choice of its `Literal`, an integer within 64 bits.
    UsageError naming the first that is not."""
    types = _field_types(cls)
    values = {key: _current_value(key, value) for key, value in values.items()}
    for key, value in values.items():
        if key not in types:
            near = difflib.get_close_matches(key, list(types), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise UsageError(f"{source}: unknown key {key!r}{hint}")
        kind = types[key]
        choices = literal_choices(kind)
        if choices:  # the type too: `true` is no 1, nor "1" the 1 of a Literal[1, 2]
            if not any(value == c and type(value) is type(c) for c in choices):
                valid = ", ".join(map(_shown, choices))
                raise UsageError(f"{flag_name(key)} {value!r} is not one of {valid}")
            continue
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if not ok and not (kind is float and isinstance(value, int)):
            raise UsageError(f"{source}: {key} = {value!r} should be a {kind.__name__}")
        if kind in (int, float) and isinstance(value, int) and not INT64[0] <= value < INT64[1]:
            raise UsageError(
                f"{flag_name(key)} {value} is outside the 64-bit integers [-2**63, 2**63); give "
                f"a value in range"
            )
    return values


def _current_value(key: str, value: Any) -> Any:
    """`value`, or what it means now if it is one field `key` took before it changed type
    (spmd.sections.FORMER_VALUES: an old file's `resume = true` is "required")."""
    former = FORMER_VALUES.get(key, {})
    return former.get(value, value) if isinstance(value, bool | str) else value


@dataclasses.dataclass(frozen=True)
class Positional:
    """A command's positional argument (argparse's `nargs`), e.g. spmd.report's files."""

    name: str
    nargs: Any
    help: str


def resolve(
    argv: list[str] | None,
    sections: dict[str, type],
    prog: str,
    *,
    expand: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    defaults: dict[str, Any] | None = None,
    description: str = "",
    positional: Positional | None = None,
    short: dict[str, str] | None = None,
    printable: bool = False,
) -> dict[str, Any]:
    """Resolve a command's config sections from defaults, preset, --config file and flags.
    Every command parses its arguments here. The result holds each section under its name,
    and under "given" the set of fields the user gave (as flags or in the --config file, and
    what `expand` derives from them), which no command learns from sys.argv itself.

    `defaults` are the command's own defaults of some fields ({field: value}), above the
    sections' (spmd.convert's mesh, spmd.plan's precision): they are not "given".
    `positional` (its value under its name in the result) and `short` flags ({field: "-n"})
    serve commands that take them. A `printable` command takes --print-config, given as
    `print_config` in the result (the command prints the config it resolves from these
    sections with `format_config`, and exits).

    The preset named by `run.model` fills the "model" section, whose type is the config of the
    model family it names (`sections["model"]`, `model_section()`, only lists the flags: every
    family's fields). `expand` may add values implied by others (it sees the non-model values
    given, flat; e.g. --layout fills --mesh)."""
    parser = build_parser(prog, sections, description, short or {}, defaults)
    if positional is not None:
        parser.add_argument(positional.name, nargs=positional.nargs, help=positional.help)
    if printable:
        parser.add_argument(
            "--print-config",
            action="store_true",
            help="print the resolved config as TOML (a file for --config) and exit",
        )
    flags = vars(parser.parse_args(argv))
    config_path = flags.pop("config", None)
    extra = {positional.name: flags.pop(positional.name)} if positional is not None else {}
    if printable:
        extra["print_config"] = flags.pop("print_config")
    given = _tables_by_section(load_toml(config_path) if config_path else {}, sections)
    model_table = dict(given.get("model", {}))  # checked once its family is known, below
    owner = field_owners(sections)
    for key, value in flags.items():
        given[owner[key]][key] = value
    if expand is not None:
        rest = expand({k: v for name, t in given.items() if name != "model" for k, v in t.items()})
        for key, value in rest.items():
            given[owner[key]][key] = value
    extra["given"] = frozenset(key for table in given.values() for key in table)
    for key, value in (defaults or {}).items():
        given[owner[key]].setdefault(key, value)
    if "model" in sections:  # the preset that run.model names, then the file's and flags'
        from models import family  # (jax and flax: not for the commands without a model)

        preset_name = given.get("run", {}).get("model", RunConfig.model)
        given["model"] = {**preset(preset_name), **given["model"]}
        source = f"model config (preset {preset_name!r})"
        # the family the values name decides the config's type; with --init-from-hf (or
        # --init-from-peft, whose adapter names its base) the folder's config.json is the
        # architecture (spmd.run.resolve reads it) and the section only carries the flags given
        # (an MoE's router knobs), whatever the preset's family
        run = given.get("run", {})
        from_hf = run.get("init_from_hf") or run.get("init_from_peft")
        cls = sections["model"] if from_hf else family.check_fields(given["model"], source)
        check_values(cls, model_table, "--config [model]")  # the values flags override too
        resolved = {"model": build(cls, given["model"], source)}
    else:
        resolved = {}
    for name, cls in sections.items():
        if name != "model":
            resolved[name] = build(cls, given[name], f"{name} config")
    return resolved | extra


def _tables_by_section(tables: dict[str, Any], sections: dict[str, type]) -> dict[str, dict]:
    """A config file's tables as {section: values}; a flat [train] table's keys go to the
    sections that own them."""
    owner = field_owners(sections)
    given: dict[str, dict[str, Any]] = {name: {} for name in sections}
    for table, values in tables.items():
        if not isinstance(values, dict):  # `run = 3` at the top: a key, not a [table]
            raise UsageError(
                f"--config: {table} = {values!r} is not a table; put fields under [section] "
                f"headers, e.g. [run] then steps = 100"
            )
        if table == FLAT_TABLE:
            for key, value in values.items():
                if key not in owner or owner[key] == "model":
                    fields = [k for k, name in owner.items() if name != "model"]
                    near = difflib.get_close_matches(key, fields, n=1)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    raise UsageError(f"--config [{FLAT_TABLE}]: unknown key {key!r}{hint}")
                check_values(sections[owner[key]], {key: value}, f"--config [{FLAT_TABLE}]")
                given[owner[key]][key] = value
        elif table in sections:
            if table != "model":  # the model family's check names the model's unknown keys
                check_values(sections[table], values, f"--config [{table}]")
            given[table].update(values)
        else:
            raise UsageError(f"--config: unknown table [{table}]; expected {list(sections)}")
    return given


def as_dict(sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Resolved sections as plain dicts (a command's own sections included; a run's Config has
    .as_dict())."""
    return {
        name: dataclasses.asdict(value)
        for name, value in sections.items()
        # not the extras: "given", a positional, ...
        if dataclasses.is_dataclass(value) and not isinstance(value, type)
    }


def format_config(sections: dict[str, Any]) -> str:
    """The resolved config as a TOML file, one table per section, which `--config` reads back
    to the same config: printed at the start of a run and by `spmd.train --print-config`."""
    tables = [
        "\n".join([f"[{name}]", *(f"{k} = {toml_value(v, k)}" for k, v in values.items())])
        for name, values in as_dict(sections).items()
    ]
    return "\n\n".join(tables)


def toml_value(value: Any, key: str) -> str:
    """`value` (a section field's: bool, int, float or str) as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):  # Python's shortest round-trip text: 0.003, 1e-05, inf
        return repr(value)
    if isinstance(value, str):  # JSON's escapes are TOML's; DEL is the one control JSON keeps
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"config field {key} = {value!r}: TOML for a {type(value).__name__}?")
