"""The output layer and loss fused over vocabulary chunks (models/fused_loss.py) train like the
unfused head: fp32 losses within 1e-5 over 10 steps on one device and on dp=2,fsdp=2,tp=2 with
the vocabulary split over `tensor`, under both executors; bf16 gradients within bf16's
rounding; Gemma's soft-cap and the MoE family's loss go through it too."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import family, fused_loss, gemma2, llama, moe
from spmd.model_shape import ModelShape
from tests import trainer

STEPS = 10
# 48 columns: the tiny model's 256-token vocabulary (128 per tensor shard) in 6 (3) chunks,
# the last padded, so the padding mask is exercised too
CHUNK = 48


def test_chunks_cover_the_vocabulary_with_the_last_padded():
    assert fused_loss.chunks(256, 48) == (6, 43)
    assert fused_loss.chunks(128256, 8192) == (16, 8016)
    assert not fused_loss.fuses(256, 0) and not fused_loss.fuses(256, 256)
    assert fused_loss.fuses(257, 256)


@pytest.mark.parametrize("executor", ["auto", "explicit"])
def test_fused_losses_equal_the_unfused_over_ten_steps_with_the_vocabulary_split(executor):
    mesh = "dp=2,fsdp=2,tp=2"
    losses = {}
    for chunk in (CHUNK, 0):
        prog = trainer.program(trainer.layout(mesh), 1, executor, loss_chunk=chunk)
        losses[chunk] = trainer.train_losses(prog, STEPS, trainer.initial_state())[0]
    assert trainer.max_relative_difference(losses[CHUNK], losses[0]) <= 1e-5


def _loss_and_grads(cfg, batch, dtype=jnp.float32):
    fam = family.of(cfg)
    graph, params = nnx.split(fam.create(cfg, 0, dtype))
    return jax.jit(jax.value_and_grad(lambda p: fam.loss(nnx.merge(graph, p), batch)))(params)


def _batch(vocab: int) -> dict:
    rng = np.random.default_rng(0)
    ints = lambda: jnp.asarray(rng.integers(0, vocab, (2, 16)), jnp.int32)  # noqa: E731
    weights = jnp.asarray(rng.random((2, 16)), jnp.float32)
    return {"inputs": ints(), "targets": ints(), "weights": weights}


SMALL = dict(vocab_size=250, embed_dim=32, mlp_dim=64, n_layers=1, n_heads=4, n_kv_heads=2)
CONFIGS = {
    # Gemma's final soft-cap narrow enough to bend most logits
    "gemma2": gemma2.Gemma2Config(**SMALL, head_dim=8, final_softcap=0.5, sliding_window=4),
    "moe": moe.MoEConfig(**SMALL, head_dim=8, n_experts=4, experts_per_token=2),
}


def test_fused_losses_equal_the_unfused_over_ten_steps_on_one_device():
    cfg, batch = llama.LlamaConfig(**SMALL, head_dim=8), _batch(250)
    losses = {}
    for chunk in (CHUNK, 0):
        fam = family.of(cfg)
        graph, params = nnx.split(fam.create(dataclasses.replace(cfg, loss_chunk=chunk), 0))

        def loss_of(p, graph=graph, fam=fam):
            return fam.loss(nnx.merge(graph, p), batch)

        @jax.jit
        def sgd(params, loss_of=loss_of):
            loss, grads = jax.value_and_grad(loss_of)(params)
            return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

        losses[chunk] = []
        for _ in range(STEPS):
            params, loss = sgd(params)
            losses[chunk].append(float(loss))
    assert trainer.max_relative_difference(np.array(losses[CHUNK]), np.array(losses[0])) <= 1e-5
    assert losses[0][-1] < losses[0][0] - 0.1  # the steps moved the model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_soft_capped_and_moe_losses_fuse_exactly(name):
    cfg, batch = CONFIGS[name], _batch(250)
    fused = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=CHUNK), batch)
    whole = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=0), batch)
    assert abs(float(fused[0]) - float(whole[0])) <= 1e-5 * abs(float(whole[0]))
    for a, b in zip(jax.tree.leaves(fused[1]), jax.tree.leaves(whole[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


def test_bf16_gradients_within_bf16_rounding():
    cfg = llama.LlamaConfig(**SMALL, head_dim=8)
    batch = _batch(250)
    fused = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=CHUNK), batch, jnp.bfloat16)
    whole = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=0), batch, jnp.bfloat16)
    assert abs(float(fused[0]) - float(whole[0])) <= 1e-2 * abs(float(whole[0]))
    for a, b in zip(jax.tree.leaves(fused[1]), jax.tree.leaves(whole[1]), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b) + 1e-6


def test_the_planner_counts_one_chunk_of_logits():
    from spmd.estimate import cost, memory, shape

    mesh = {"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 2}
    sizes = shape.release_for(1e9).fields()  # Llama 3.2 1B: vocab 128256
    setups = {
        chunk: cost.Setup(
            shape=ModelShape(**sizes, loss_chunk=chunk),
            n_params=1e9,
            mesh=mesh,
            zero=3,
            precision="bf16",
            optimizer="adamw",
            batch=8,
            seq_len=2048,
            accum=1,
        )
        for chunk in (0, 8192)
    }
    tokens = 8 * 2048  # 16 chunks of 8016 columns, 4008 of each on a device
    saved = 2 * tokens * (128256 / 2 - 4008) * 4
    assert memory.activation_bytes(setups[0]) - memory.activation_bytes(setups[8192]) == saved
    piped = {c: dataclasses.replace(s, mesh={**mesh, "pipeline": 2}) for c, s in setups.items()}
    assert memory.activation_bytes(piped[0]) == memory.activation_bytes(piped[8192])
