"""Gemma 3's own features (tests/test_conformance.py checks the hf_gemma3 fixture's logits,
its two rotary settings, greedy tokens, round trip, training, planner, dry run and what it
does not compute like every family's): a transformers 4 config.json reads like the
transformers 5 one, and a pipeline stage must hold whole periods of its local / global
pattern while context parallelism is refused."""

import dataclasses
import json

import pytest

from models import gemma2, hf_gemma2
from spmd.errors import UsageError
from tests import trainer
from tests.hf_fixtures import FIXTURES, ONE, loaded

NAME = "hf_gemma3"


def test_a_transformers_4_config_reads_like_the_transformers_5_one():
    raw = json.loads((FIXTURES / NAME / "config.json").read_text())
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6)
    old.update(rope_scaling={"rope_type": "linear", "factor": 4.0})
    read = hf_gemma2.fields
    assert read(old, "old", "none", hf_gemma2.GEMMA3) == read(raw, "new", "none", hf_gemma2.GEMMA3)


def test_a_pipeline_stage_must_hold_whole_periods_and_cp_is_accepted():
    cfg = dataclasses.replace(loaded(NAME, ONE).model, n_layers=12)
    gemma2.check_layout(cfg, trainer.layout("pp=2,dp=4").mesh, "auto")  # 6 layers a stage
    with pytest.raises(UsageError, match="multiple of --global-every 6"):
        gemma2.check_layout(cfg, trainer.layout("pp=4,dp=2").mesh, "auto")
    gemma2.check_layout(cfg, trainer.layout("dp=4,cp=2").mesh, "auto")  # cp composes
