"""The qwen3_moe family's own features (tests/test_conformance.py checks the hf_qwen3_moe
fixture's logits with the experts split, routing, greedy tokens, round trip, training under
both executors, the planner, a dry run and what spmd does not compute like every family's):
norm_topk_prob switches the router's weights as transformers does, transformers 5's
num_local_experts spelling reads alike, what neither architecture expresses is refused on
export, a pipeline runs only without router losses, the planner's train command keeps the
expert flags, and the registry finds the family by architecture and model_type."""

import dataclasses
import json

import pytest

from models import family, hf_mixtral, hf_qwen3_moe, moe, qwen3_moe
from spmd import plan, train
from spmd.errors import UsageError
from tests import trainer
from tests.hf_fixtures import (
    FIXTURES,
    ONE,
    loaded,
    logits_of,
    reference,
    relative_difference,
    with_config,
)

FIXTURE = FIXTURES / "hf_qwen3_moe"
NAME = FIXTURE.name


def test_norm_topk_prob_switches_the_routers_weights_as_transformers_does():
    """The same weights with norm_topk_prob true give transformers' logits for that setting,
    which are far from the fixture's own (the switch matters at 0.2 of the largest logit)."""
    switched = with_config(loaded(NAME, ONE), ONE, norm_topk_prob=True)
    logits = logits_of(switched, reference(NAME)["input_ids"])
    assert relative_difference(logits, reference(NAME)["logits_normalized"]) <= 1e-4
    assert relative_difference(logits, reference(NAME)["logits"]) > 1e-2


def test_transformers_5s_num_local_experts_spelling_reads_alike(tmp_path):
    raw = json.loads((FIXTURE / "config.json").read_text())
    raw["num_local_experts"] = raw.pop("num_experts")
    assert qwen3_moe.config_from_hf(raw, "t5") == loaded(NAME, ONE).model


def test_what_neither_architecture_expresses_is_refused_on_export():
    cfg = loaded(NAME, ONE).model
    with pytest.raises(UsageError, match="qk_norm False"):
        hf_qwen3_moe.hf_config_of(dataclasses.replace(cfg, qk_norm=False), "float32", 64)
    mixtral = moe.MoEConfig(**(vars(cfg) | {"family": "moe", "qk_norm": False, "mlp_dim": 24}))
    with pytest.raises(UsageError, match="norm_topk_prob False"):  # Mixtral always renormalises
        hf_mixtral.mixtral_hf_config(mixtral, "float32", 64)


def test_a_pipeline_runs_the_identical_blocks_only_without_router_losses():
    cfg = loaded(NAME, ONE).model
    pipeline = trainer.layout("pp=2").mesh
    with pytest.raises(UsageError, match="pp=2 cannot carry the MoE router losses"):
        family.of(cfg).check_layout(cfg, pipeline, "auto")
    family.of(cfg).check_layout(dataclasses.replace(cfg, aux_loss_coef=0.0), pipeline, "auto")
    with pytest.raises(UsageError, match="--n-experts 0"):
        qwen3_moe.check(dataclasses.replace(cfg, n_experts=0))


def test_the_planners_train_command_keeps_the_expert_flags(capsys):
    """spmd.plan --recommend writes the train command of a qwen3_moe model with its experts
    (the MoE shape flags go with every family whose config has them, not with "moe" only)."""
    args = ["--model", "moe-tiny", "--family", "qwen3_moe", "--n-experts", "8", "--batch", "8"]
    assert plan.main([*args, "--devices", "4", "--recommend", "--json"]) == 0
    command = json.loads(capsys.readouterr().out)["recommendation"]["train_command"]
    assert "--family qwen3_moe" in command and " --n-experts 8 " in command
    # the family's own defaults that the moe-tiny preset lacks go with it too
    assert "--norm-topk-prob false" in command and "--qk-norm true" in command


def test_the_registry_finds_the_family_by_architecture_and_model_type():
    assert family.for_hf({"architectures": ["Qwen3MoeForCausalLM"]}, "x") is qwen3_moe.FAMILY
    assert family.for_hf({"model_type": "qwen3_moe"}, "x") is qwen3_moe.FAMILY


def test_a_run_from_the_folder_keeps_norm_topk_prob_false():
    """The run's [model] (what the dry run of tests/test_conformance.py echoes only where it
    differs from the defaults)."""
    assert train.resolve_sections(["--init-from-hf", str(FIXTURE)])["model"].norm_topk_prob is False
