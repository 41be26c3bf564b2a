"""Document-aware packing and loss masks: a window holding two documents gives each the logits
it has alone; segment ids and loss weights travel with the batch through both executors and
gradient accumulation and pipeline schedules, and the loss counts exactly the masked-in
targets."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import attention, llama
from spmd.io import data
from spmd.model_shape import query_chunks
from tests import trainer

SEQ_LEN, BATCH = trainer.SEQ_LEN, trainer.BATCH


def test_two_documents_in_a_window_get_the_logits_they_have_alone():
    model = llama.create(trainer.tiny_config(), seed=0)
    rng = np.random.default_rng(0)
    first, second = rng.integers(1, 256, 11), rng.integers(1, 256, SEQ_LEN - 11)
    window = np.concatenate([first, second])[None]
    segments = np.repeat([0, 1], [11, SEQ_LEN - 11])[None]
    packed = model(jnp.asarray(window), jnp.asarray(segments))
    alone = [model(jnp.asarray(doc[None])) for doc in (first, second)]
    np.testing.assert_allclose(packed[:, :11], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[:, 11:], alone[1], atol=1e-5, rtol=0)
    assert np.abs(model(jnp.asarray(window))[:, 11:] - alone[1]).max() > 1e-2  # without: not
    positions = llama.segment_positions(jnp.asarray(segments))
    np.testing.assert_array_equal(positions[0], np.r_[np.arange(11), np.arange(SEQ_LEN - 11)])
    # The fp16 path's written-out attention masks documents the same way.
    q, k, v = (jnp.asarray(rng.normal(size=(1, SEQ_LEN, h, 8)), jnp.float32) for h in (8, 4, 4))
    np.testing.assert_allclose(
        attention.grouped_causal_attention(q, k, v, jnp.asarray(segments)),
        attention.causal_attention(q, k, v, jnp.asarray(segments)),
        atol=1e-5,
    )


@pytest.mark.parametrize("length, window", [(128, 0), (128, 40), (64, 5)])
def test_chunked_attention_equals_the_whole_square_with_documents(length, window):
    """XLA's kernel in query chunks (4 at length 128, 2 at 64), each over the keys it can see
    and recomputed in the backward pass, gives the whole-square kernel's outputs and
    gradients, with documents and sliding windows."""
    assert query_chunks(length) == (4 if length == 128 else 2)
    rng = np.random.default_rng(length + window)
    q, k, v, w = (
        jnp.asarray(rng.normal(size=(2, length, h, 8)), jnp.float32) for h in (8, 4, 4, 8)
    )
    segments = jnp.asarray(np.sort(rng.integers(0, 4, (2, length)), axis=1))

    def loss(kernel):
        return jax.value_and_grad(
            lambda q, k, v: jnp.sum(kernel(q, k, v, segments, window) * w), argnums=(0, 1, 2)
        )(q, k, v)

    chunked = loss(attention.chunked_causal_attention)
    whole = loss(attention.grouped_causal_attention)
    for got, want in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(jnp.abs(want).max()))


def test_the_moe_model_keeps_documents_apart_too():
    # Dropless routing is per token, so each document's logits are its own here as well.
    from models import moe
    from spmd.run import config

    cfg = config.build(moe.MoEConfig, config.preset("moe-tiny"), "moe-tiny")
    model = moe.create(cfg, seed=0)
    rng = np.random.default_rng(2)
    first, second = rng.integers(1, 256, 9), rng.integers(1, 256, SEQ_LEN - 9)
    packed = model(
        jnp.asarray(np.concatenate([first, second])[None]),
        jnp.asarray(np.repeat([0, 1], [9, SEQ_LEN - 9])[None]),
    )
    np.testing.assert_allclose(packed[:, :9], model(jnp.asarray(first[None])), atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[:, 9:], model(jnp.asarray(second[None])), atol=1e-5, rtol=0)


def packed_windows() -> data.TokenWindows:
    """Random documents of 5 to 40 tokens, each ending in 0, with a prompt (the first third,
    not counted) and a response (counted, end token included)."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(5, 40, 200)
    tokens = rng.integers(1, 256, lengths.sum()).astype(np.uint16)
    ends = np.cumsum(lengths)
    tokens[ends - 1] = 0
    mask = np.ones(len(tokens), np.uint8)
    for start, length in zip(ends - lengths, lengths, strict=True):
        mask[start : start + length // 3] = 0
    return data.TokenWindows(tokens, SEQ_LEN, 0.0, ends, mask, document_mask=True)


def test_windows_carry_segments_and_normalized_loss_weights():
    windows = packed_windows()
    assert windows.fields == ("inputs", "targets", "segments", "weights")
    ids = np.array([0, 3])
    segments = windows.segments(ids)
    starts = ids[:, None] * SEQ_LEN + np.arange(SEQ_LEN)
    expected = np.searchsorted(windows.document_ends, starts, side="right")
    np.testing.assert_array_equal(segments, expected - expected[:, :1])
    weights = windows.loss_weights(ids)
    mask = windows.loss_mask[starts + 1]
    np.testing.assert_allclose(weights, mask * mask.size / mask.sum())
    assert abs(weights.mean() - 1.0) < 1e-6


def test_masked_loss_and_documents_in_both_executors_with_accumulation():
    windows = packed_windows()
    ids = data.train_window_ids(0, 0, BATCH, windows.n_train)
    host = {
        k: np.asarray(v)
        for k, v in data.global_batch(windows, ids, trainer.layout("dp=1").batch_sharding()).items()
    }
    # Oracle: the unsharded model, the mean over counted targets only, written out here.
    model = llama.create(trainer.tiny_config(), seed=0)

    def masked_mean(model):
        logits = model(host["inputs"], host["segments"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, host["targets"])
        counted = host["weights"] > 0
        return jnp.sum(jnp.where(counted, losses, 0)) / counted.sum()

    loss, grads = nnx.value_and_grad(masked_mean)(model)
    expected_norm = float(optax.tree.norm(nnx.to_pure_dict(grads)))
    results = [
        train(trainer.program(trainer.layout(mesh), accum=2, executor=executor), windows, 1)
        for mesh, executor in (("dp=2,fsdp=2", "auto"), ("dp=2,tp=2", "explicit"))
    ]
    for metrics in results:
        np.testing.assert_allclose(metrics[0]["loss"], loss, rtol=2e-6)
        np.testing.assert_allclose(metrics[0]["grad_norm"], expected_norm, rtol=1e-4)


def train(prog, windows: data.TokenWindows, steps: int) -> list[dict]:
    """The metrics of `steps` train steps of `prog` on `windows` (all their batch fields), from
    the shared seed-0 init."""
    prog.batch_fields = windows.fields
    state = jax.tree.map(
        lambda x, t: jax.device_put(x, t.sharding),
        tuple(trainer.initial_state()),
        (prog.abstract_params, prog.abstract_opt_state, prog.abstract_loss_scale),
    )
    results = []
    for step in range(steps):
        ids = data.train_window_ids(0, step, BATCH, windows.n_train)
        *state, metrics = prog.train_step(
            *state, data.global_batch(windows, ids, prog.layout.batch_sharding())
        )
        results.append(jax.device_get(metrics))
    return results


def test_pipelines_carry_segments_and_loss_weights_with_their_micro_batches():
    # Oracle: one device on the same packed, masked batches. The schedules run each chunk's
    # attention on its micro-batch's segment ids and the head's loss on its weights.
    from spmd.parallel.pipeline import Pipeline

    windows, steps = packed_windows(), 3
    expected = train(trainer.program(trainer.layout("dp=1")), windows, steps)
    runs = (
        ("pp=2", "auto", Pipeline("1f1b", 0, 1, llama.logits_loss), 2),
        ("dp=2,pp=2,tp=2", "explicit", Pipeline("gpipe", 0, 1, llama.logits_loss), 1),
    )
    for mesh, executor, pipe, accum in runs:
        prog = trainer.program(trainer.layout(mesh), accum, executor, pipe)
        got = train(prog, windows, steps)
        # Measured: 2.4e-7 (loss) and 1.2e-7 (grad norm) apart; a chunk that drops the segment
        # ids is 2e-5 / 3% off, a head that drops the weights 6e-5 / 14%.
        for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4)):
            np.testing.assert_allclose(
                [m[key] for m in got], [m[key] for m in expected], rtol=rtol, err_msg=mesh
            )


def test_document_mask_choices_are_checked():
    import pytest

    from spmd.errors import UsageError
    from spmd.io import run_data
    from spmd.run.config import flat

    with pytest.raises(UsageError, match="--document-mask 'yes' is not one of auto, on, off"):
        run_data.check_choices(flat(None, document_mask="yes").data)
    with pytest.raises(UsageError, match="give both"):
        run_data.check_choices(flat(None, prompt_field="q").data)
    plain = np.arange(10 * SEQ_LEN + 1)
    with pytest.raises(UsageError, match="--document-mask on needs a corpus read record by"):
        data.TokenWindows(plain, SEQ_LEN, 0.0, document_mask=True)
