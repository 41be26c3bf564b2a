"""The MXFP4 dequantizer (models/mxfp4.py) against transformers' own
(convert_moe_packed_tensors, run once by tests/fixtures/make_mxfp4.py into mxfp4.npz)."""

from pathlib import Path

import numpy as np
import pytest

from models import mxfp4
from spmd.errors import UsageError

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mxfp4.npz"


def test_dequantize_equals_transformers_bit_for_bit():
    ref = np.load(FIXTURE)
    got = mxfp4.dequantize(ref["blocks"], ref["scales"])
    assert got.dtype == np.float32 and got.shape == ref["weight"].shape == (3, 64, 8)
    np.testing.assert_array_equal(got, ref["weight"])
    # the fixture reaches both signs and scales on both sides of 1
    assert (got < 0).any() and (np.abs(got) > 6).any() and (0 < np.abs(got)).any()


def test_nibble_order_and_scale():
    # byte 0x21: low nibble 1 (0.5) is the first value, high nibble 2 (1.0) the second; the
    # high nibble 0xF of 0xF8 is -6, its low 8 is -0; scale code 128 doubles them
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, :2] = [0x21, 0xF8]
    got = mxfp4.dequantize(blocks, np.full((1, 1), 128, np.uint8))  # [in 32, out 1]
    np.testing.assert_array_equal(got[:4, 0], [1.0, 2.0, -0.0, -12.0])
    assert np.signbit(got[2, 0]) and not got[4:].any()


@pytest.mark.parametrize(
    "blocks, scales, says",
    [
        (np.zeros((2, 1, 16), np.int8), np.zeros((2, 1), np.uint8), "must be uint8"),
        (np.zeros((2, 1, 8), np.uint8), np.zeros((2, 1), np.uint8), "[..., out, G, 16]"),
        (np.zeros((2, 1, 16), np.uint8), np.zeros((2, 2), np.uint8), "[..., out, G]"),
    ],
)
def test_refuses_what_is_not_mxfp4(blocks, scales, says):
    with pytest.raises(UsageError, match="down_proj") as e:
        mxfp4.dequantize(blocks, scales, "down_proj")
    assert says in str(e.value)
