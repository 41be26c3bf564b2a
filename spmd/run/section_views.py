"""Sections made for the command line from other sections: each field's --help text (its
comment in the class source), a view of some of a section's fields, and the model section's
flags, the union of every registered model family's config fields (models.family.FAMILIES).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from typing import Any, Literal

from spmd.sections import literal_choices


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment in the class source}: the comment on the field's line, else the
    comment lines just above it. The comments document the defaults, so --help shows them."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source (a frozen or generated class): flags without help
        return {}
    comments, above = {}, []
    for line in (raw.strip() for raw in lines):
        if line.startswith("#"):
            above.append(line[1:].strip())
            continue
        field = re.match(r"(\w+)\s*:\s*\S", line)
        if field:
            trailing = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            if trailing or above:
                comments[field.group(1)] = trailing or " ".join(above)
        above = []
    return comments


def field_help(cls: type) -> dict[str, str]:
    """{field: its --help text}: a derived section's `help` metadata (`derived_section`), else
    the field's comment in the class source, a subclass's own over its bases' (MoEConfig's)."""
    comments: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        comments.update(field_comments(base))
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            comments[f.name] = f.metadata["help"]
    return comments


def derived_section(name: str, fields: list[tuple[str, Any, Any, str]]) -> type:
    """A frozen dataclass `name` of `fields` (name, type, default or dataclasses.MISSING, help):
    a section made from other sections' fields (the model families' union, a command's view
    of the run's fields), each keeping its type, default and help."""
    specs = [
        (field, kind, dataclasses.field(default=default, metadata={"help": text}))
        for field, kind, default, text in fields
    ]
    return dataclasses.make_dataclass(name, specs, frozen=True, kw_only=True)


def view(cls: type, names: tuple[str, ...], name: str = "") -> type:
    """Section `cls` with only the fields `names` (in its order), with their types, defaults
    and help: the run's fields a command shares (spmd.bench_collectives' model and batch)."""
    hints, helps = typing.get_type_hints(cls), field_help(cls)
    kept = [f for f in dataclasses.fields(cls) if f.name in names]
    rows = [(f.name, hints[f.name], f.default, helps.get(f.name, "")) for f in kept]
    return derived_section(name or cls.__name__, rows)


def model_section() -> type:
    """The model section's flags: every field of every registered family's config
    (models.family.FAMILIES), so that a family registered later has its flags with no edit
    here. A field's type, default and help are those of the first family declaring it; a
    `Literal` field takes any family's choices (the family `--family` names checks its own)."""
    from models import family  # (jax and flax: not for the commands without a model)

    return _union_section(tuple((f.name, f.config) for f in family.FAMILIES.values()))


@functools.cache
def _union_section(families: tuple[tuple[str, type], ...]) -> type:
    rows: dict[str, list] = {}
    for _, cls in families:
        hints, helps = typing.get_type_hints(cls), field_help(cls)
        for f in dataclasses.fields(cls):
            if f.name not in rows:
                rows[f.name] = [f.name, hints[f.name], f.default, helps.get(f.name, "")]
                continue
            row, kind = rows[f.name], hints[f.name]
            known = literal_choices(row[1])
            extra = [c for c in literal_choices(kind) if c not in known]
            if known and extra:  # e.g. a family with a remat policy of its own
                row[1] = Literal[(*known, *extra)]  # type: ignore[valid-type]
            row[3] = row[3] or helps.get(f.name, "")
    names = tuple(name for name, _ in families)
    about = f"the model family: {', '.join(names)} (the preset names it; its fields apply)"
    rows["family"][1:4:2] = [Literal[names], about]
    return derived_section("ModelFlags", [tuple(row) for row in rows.values()])
