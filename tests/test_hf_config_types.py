"""transformers' config classes check each field's type on load (transformers 5 refuses
`"query_pre_attn_scalar": 24.0` where Gemma's config declares an int), so every value of an
exported config.json must have the JSON type transformers itself writes there. The fixtures'
config.json files were written by transformers' config classes (tests/fixtures/make_hf.py):
each registered family's `--to-hf` config (the dict models/family.save_hf writes as
config.json for spmd.convert) is held to its fixtures', key by key, nested tables
included. Read with json only: no transformers here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from models import family
from spmd.errors import UsageError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HF_FOLDERS = sorted(p.parent.name for p in FIXTURES.glob("hf_*/config.json"))


def json_type(value: Any) -> str:
    """The JSON type of `value` as transformers' strict fields tell them apart (int and float
    apart, bool apart from both)."""
    return "bool" if isinstance(value, bool) else type(value).__name__


def mismatches(fixture: dict, exported: dict, where: str = "") -> list[str]:
    """The keys both configs hold whose values differ in JSON type (null matches any: an
    optional field)."""
    found = []
    for key in fixture.keys() & exported.keys():
        want, got = fixture[key], exported[key]
        if want is None or got is None:
            continue
        if isinstance(want, dict) and isinstance(got, dict):
            found += mismatches(want, got, f"{where}{key}.")
        elif json_type(want) != json_type(got):
            found.append(f"{where}{key}: {got!r} ({json_type(got)}), transformers writes "
                         f"{want!r} ({json_type(want)})")  # fmt: skip
    return found


def test_every_registered_family_has_a_fixture():
    read = {family.for_hf(json.loads((FIXTURES / n / "config.json").read_text()), n).name
            for n in HF_FOLDERS}  # fmt: skip
    assert read == {name for name, fam in family.FAMILIES.items() if fam.hf is not None}


@pytest.mark.parametrize("name", HF_FOLDERS)
def test_the_exported_config_has_the_types_transformers_writes(name):
    folder = family.open_hf(str(FIXTURES / name))  # headers only: no tensor is read
    fixture = folder.raw_config
    positions = fixture.get("max_position_embeddings", 2048)
    # what family.save_hf writes as config.json (through json, as the file holds it)
    written = family.of(folder.config).hf.config_to_hf(folder.config, "float32", positions)
    exported = json.loads(json.dumps(written))
    assert len(fixture.keys() & exported.keys()) >= 10  # the fields that describe the model
    assert mismatches(fixture, exported) == []


def test_a_query_scale_no_gemma_config_holds_is_refused_on_export():
    cfg = family.open_hf(str(FIXTURES / "hf_gemma2")).config
    cfg = dataclasses.replace(cfg, query_pre_attn_scalar=24.5)  # transformers: an int
    with pytest.raises(UsageError, match="query_pre_attn_scalar 24.5"):
        family.of(cfg).hf.config_to_hf(cfg, "float32", 64)
