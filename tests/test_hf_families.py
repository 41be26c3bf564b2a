"""The Llama variants' own features (tests/test_conformance.py checks their fixtures'
logits, greedy tokens, round trip and training like every family's): Llama 3's rope bands
against transformers' inverse frequencies, the sliding-window kernels against the band written
out, a window with context parallelism refused, and a model no architecture has refused on
export."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, hf_config
from models.rope import Rope
from spmd import train
from spmd.errors import UsageError
from tests.hf_fixtures import FIXTURES, ONE, loaded, reference


def test_llama3_inverse_frequencies_equal_those_of_transformers_in_every_band():
    cfg = loaded("hf_llama3", ONE).model
    expected = reference("hf_llama3")["inv_freq"]
    np.testing.assert_allclose(Rope.of(cfg).inv_freq(cfg.head_dim), expected, rtol=1e-6)
    half = cfg.head_dim // 2
    wavelength = 2 * np.pi * cfg.rope_theta ** (np.arange(half) / half)
    context = cfg.rope_original_max_positions
    kept = wavelength < context / cfg.rope_high_freq_factor
    scaled = wavelength > context / cfg.rope_low_freq_factor
    assert kept.sum() and scaled.sum() and (~kept & ~scaled).sum()  # all three bands occur
    plain = cfg.rope_theta ** (-np.arange(half) / half)
    np.testing.assert_allclose(expected[kept], plain[kept], rtol=1e-6)
    np.testing.assert_allclose(expected[scaled], plain[scaled] / cfg.rope_factor, rtol=1e-6)
    blended = ~kept & ~scaled
    assert np.all(expected[blended] < plain[blended])
    assert np.all(expected[blended] > plain[blended] / cfg.rope_factor)


def test_the_window_kernels_agree_with_the_band_written_out():
    """XLA's attention (jax's local window), the fp16 path's written-out kernel and a brute-force
    mask agree, with and without packed documents: key j is seen from query i when
    i - window < j <= i (and j is in i's document)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, s, 8)), jnp.float32) for s in (4, 2, 2))
    segments = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [5, 4, 3], axis=1))
    for docs in (None, segments):
        fused = attention.causal_attention(q, k, v, docs, window=3)
        written = attention.grouped_causal_attention(q, k, v, docs, window=3)
        i, j = np.arange(12)[:, None], np.arange(12)[None, :]
        band = jnp.asarray((j <= i) & (j > i - 3))[None]
        if docs is not None:
            band = band & attention.same_document(docs)
        logits = jnp.einsum("btkgd,bskd->bkgts", q.reshape(2, 12, 2, 2, 8), k) * 8**-0.5
        logits = jnp.where(band[:, None, None], logits, -jnp.inf)
        brute = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(logits, -1), v).reshape(q.shape)
        np.testing.assert_allclose(fused, brute, rtol=0, atol=1e-5)
        np.testing.assert_allclose(written, brute, rtol=0, atol=1e-5)


def test_a_sliding_window_with_context_parallelism_trains_as_without(tmp_path):
    """The ring masks the window by global position: Mistral's window 5 at cp=2 gives the
    losses of the same run with whole sequences (fp32, 2 steps, within 1e-5 relative)."""
    from tests.cli import records

    corpus = tmp_path / "digits.txt"  # bytes below 64: the fixture's vocab is 64
    corpus.write_text("0123456789 " * 200)
    losses = []
    for mesh in ("dp=4,cp=2", "dp=4"):
        metrics = tmp_path / f"{mesh}.jsonl"
        args = ["--init-from-hf", str(FIXTURES / "hf_mistral"), "--mesh", mesh]
        args += ["--data", str(corpus), "--data-cache", str(tmp_path / "cache")]
        args += ["--steps", "2", "--batch", "8", "--seq-len", "16", "--precision", "fp32"]
        args += ["--log-every", "1", "--eval-every", "0", "--metrics", str(metrics)]
        assert train.main(args) == 0
        losses.append([r["loss"] for r in records(metrics) if r["kind"] == "train"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_a_model_no_architecture_has_is_refused_on_export():
    cfg = dataclasses.replace(loaded("hf_qwen3", ONE).model, qkv_bias=True)
    with pytest.raises(UsageError, match="has no Hugging Face architecture"):
        hf_config.hf_config(cfg, "float32", 64)
    assert hf_config.hf_architecture(dataclasses.replace(cfg, qk_norm=False)) == (
        "Qwen2ForCausalLM"
    )
