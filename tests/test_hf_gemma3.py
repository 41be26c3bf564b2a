"""Gemma 3 (text) against transformers: a tiny Gemma3ForCausalLM written by `transformers`
itself (tests/fixtures/make_hf_gemma.py) with 7 layers (five local, one global, one local),
a window of 5, q/k norms and two rotary bases (the global one linearly scaled) gives
transformers' logits and greedy tokens on one device and dp=2,fsdp=2,tp=2, converts HF ->
spmd -> HF bit for bit, trains alike sharded (auto executor) and on one device, is costed by
the planner as compiled, and starts a --dry-run training run; the vision tower and what else
Gemma 3 does not compute exit 2 naming the field. The helpers are tests/test_hf_gemma2.py's."""

import dataclasses
import json

import pytest

from models import gemma2, hf_gemma2
from spmd import convert, train
from spmd.errors import UsageError
from tests import trainer
from tests.test_hf_families import edited, loaded
from tests.test_hf_gemma2 import (
    FIXTURES,
    MESHES,
    check_greedy,
    check_round_trip,
    check_training,
    logit_difference,
)

NAME = "hf_gemma3"


@pytest.mark.parametrize("mesh", MESHES)
def test_logits_equal_those_of_transformers(mesh):
    cfg = loaded(NAME, mesh).model
    assert cfg.family == "gemma3" and cfg.qk_norm and cfg.n_layers == 7
    assert (cfg.global_every, cfg.sliding_window, cfg.attn_softcap) == (6, 5, 0.0)
    assert (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling) == (1e4, 1e6, "linear")
    difference = logit_difference(NAME, mesh)
    print(f"gemma3 {mesh}: max logit difference / max logit {difference:.2e}")
    assert difference <= 1e-4


@pytest.mark.parametrize(
    "change",
    [{"rope_local_theta": 1e6}, {"rope_scaling": "none"}],
    ids=["one-rope-base", "no-linear-scaling"],
)
def test_the_fixture_depends_on_the_two_rotary_settings(change):
    assert logit_difference(NAME, "dp=1", **change) > 1e-2


def test_greedy_generation_equals_that_of_transformers():
    check_greedy(NAME)


def test_hf_to_spmd_to_hf_is_bit_exact_through_the_commands(tmp_path):
    check_round_trip(NAME, tmp_path)


def test_training_steps_on_a_sharded_mesh_equal_one_device_and_the_planner():
    check_training(NAME, "auto")


def test_a_transformers_4_config_reads_like_the_transformers_5_one():
    raw = json.loads((FIXTURES / NAME / "config.json").read_text())
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6)
    old.update(rope_scaling={"rope_type": "linear", "factor": 4.0})
    read = hf_gemma2.fields
    assert read(old, "old", "none", hf_gemma2.GEMMA3) == read(raw, "new", "none", hf_gemma2.GEMMA3)


def test_a_pipeline_stage_must_hold_whole_periods_and_cp_is_refused():
    cfg = dataclasses.replace(loaded(NAME, "dp=1").model, n_layers=12)
    gemma2.check_layout(cfg, trainer.layout("pp=2,dp=4").mesh, "auto")  # 6 layers a stage
    with pytest.raises(UsageError, match="multiple of --global-every 6"):
        gemma2.check_layout(cfg, trainer.layout("pp=4,dp=2").mesh, "auto")
    with pytest.raises(UsageError, match="cp=2 with a gemma3 model"):
        gemma2.check_layout(cfg, trainer.layout("dp=4,cp=2").mesh, "auto")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"vision_config": {"hidden_size": 16}}, "vision_config"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
            "rope type 'yarn' of the full_attention layers",
        ),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope type 'linear' of the sliding_attention layers",
        ),
    ],
    ids=["vision", "conditional-generation", "attn-softcap", "yarn", "local-scaling"],
)
def test_what_gemma3_does_not_compute_exits_2_naming_it(tmp_path, capsys, changes, named):
    args = ["--from-hf", edited(tmp_path, NAME, **changes), "--to", str(tmp_path / "out")]
    assert convert.main([*args, "--mesh", "fsdp=-1"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_training_run_starts_from_the_gemma3_folder(tmp_path, capsys):
    """`spmd.train --init-from-hf <folder> --dry-run`: the run's model is the family's config
    of config.json, and the step compiles (its memory and collectives printed)."""
    corpus = tmp_path / "digits.txt"  # bytes below 64: the fixture's vocab is 64
    corpus.write_text("0123456789 " * 200)
    args = ["--init-from-hf", str(FIXTURES / NAME), "--mesh", "dp=2,fsdp=2,tp=2"]
    args += ["--data", str(corpus), "--data-cache", str(tmp_path / "cache")]
    args += ["--steps", "2", "--batch", "8", "--seq-len", "16", "--dry-run"]
    assert train.main(args) == 0
    out = capsys.readouterr()
    assert "gemma3" in out.out + out.err
