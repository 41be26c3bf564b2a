"""The glm4_moe family's own features (tests/test_conformance.py checks the hf_glm4_moe fixture
against transformers): a release's multi-token-prediction layer is skipped on import with a
line that says so, and a model the architecture cannot express is refused on export."""

import dataclasses

import numpy as np
import pytest

from models import family, hf_glm4_moe
from spmd import convert
from spmd.errors import UsageError
from spmd.io import safetensors_io
from tests.hf_fixtures import FIXTURES, edited


def test_a_release_s_prediction_layer_is_skipped_on_import(tmp_path, capsys):
    """GLM-4.5 and DeepSeek-V3 ship num_nextn_predict_layers layers after the decoder's
    (model.layers.{n_layers}.*); transformers skips them, and so does spmd, saying so; any
    other stray tensor is still refused."""
    folder = edited(tmp_path, "hf_glm4_moe", num_nextn_predict_layers=1)
    extra = {"model.layers.3.eh_proj.weight": np.ones((16, 32), np.float32)}
    extra["model.layers.3.enorm.weight"] = np.ones((16,), np.float32)
    entries = [(k, v.shape, v.dtype) for k, v in extra.items()]
    safetensors_io.write(tmp_path / "hf_glm4_moe" / "mtp.safetensors", entries, extra.__getitem__)
    out = tmp_path / "out"
    assert convert.main(["--from-hf", folder, "--to", str(out), "--mesh", "dp=1"]) == 0
    assert "skipping 2 tensors of the 1 multi-token-prediction layer(s)" in capsys.readouterr().err
    stray = edited(tmp_path / "stray", "hf_glm4_moe", num_nextn_predict_layers=0)
    safetensors_io.write(tmp_path / "stray" / "hf_glm4_moe" / "mtp.safetensors", entries,
                         extra.__getitem__)  # fmt: skip
    assert convert.main(["--from-hf", stray, "--to", str(tmp_path / "o2"), "--mesh", "dp=1"]) == 2
    assert "holds tensor model.layers.3.eh_proj.weight" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, named",
    [({"dense_layers": "1"}, "dense_layers 1"), ({"router_score": "softmax"}, "router_score"),
     ({"router_bias": False}, "router_bias False")],
)  # fmt: skip
def test_what_the_architecture_cannot_express_is_refused_on_export(change, named):
    cfg = dataclasses.replace(family.open_hf(str(FIXTURES / "hf_glm4_moe")).config, **change)
    with pytest.raises(UsageError, match=named):
        hf_glm4_moe.hf_config_of(cfg, "float32", 64)
