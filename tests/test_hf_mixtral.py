"""The moe family's Mixtral mapping, what the common checks do not show (tests/test_conformance.py
checks the hf_mixtral fixture's logits with the experts split, greedy tokens, round trip,
--init-from-hf and what it lacks like every family's): a shared expert has no Mixtral
equivalent, random moe-tiny params go to a sharded Mixtral folder and back bit for bit, and
--init-from-hf keeps the router knobs given as flags."""

import dataclasses

import pytest

from models import family, hf_mixtral, moe
from spmd import train
from spmd.errors import UsageError
from spmd.run import config, weights
from tests import trainer
from tests.hf_fixtures import FIXTURES, assert_params_equal, save_random_params

MIXTRAL = FIXTURES / "hf_mixtral"


def test_a_shared_expert_has_no_mixtral_equivalent(tmp_path):
    cfg = family.open_hf(str(MIXTRAL)).config
    with pytest.raises(UsageError, match="shared_expert True"):
        hf_mixtral.mixtral_hf_config(
            type(cfg)(**{**cfg.__dict__, "shared_expert": True}), "float32", 64
        )


def test_spmd_moe_params_to_hf_and_back_are_bit_exact(tmp_path):
    """Random params of the moe-tiny preset (not a Mixtral made by transformers) on one mesh
    -> a sharded Mixtral folder -> the same params on another mesh, bit for bit."""
    cfg = dataclasses.replace(moe.MoEConfig(**config.preset("moe-tiny")), z_loss_coef=0.0)
    params, files = save_random_params(cfg, "fsdp=2,ep=2,tp=2", tmp_path / "hf", 100_000)
    assert len(files) > 3  # several shards, the index and config.json
    back = family.open_hf(str(tmp_path / "hf"))
    assert back.config == cfg  # z-loss 0: Mixtral has none, so a non-zero one does not survive
    target = weights.model_program(cfg, trainer.layout("dp=2,ep=4"))
    assert_params_equal(family.load_hf(back, target.abstract_params), params)


def test_init_from_hf_keeps_the_router_knobs_given_as_flags():
    folder = str(MIXTRAL)
    given = train.resolve_sections(["--init-from-hf", folder, "--capacity-factor", "1.25"])
    assert given["model"].capacity_factor == 1.25 and given["model"].n_experts == 4
    default = train.resolve_sections(["--init-from-hf", folder])
    assert default["model"].capacity_factor == 0.0  # Mixtral is dropless
