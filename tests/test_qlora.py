"""QLoRA (--lora-base-dtype nf4, models/nf4.py): the NF4 format is bitsandbytes' code book and
block rule, the frozen base is held as 4-bit codes sharded like the weights they replace, and
a LoRA run on it trains as LoRA on the dequantized base does, on one device, fsdp=2 ZeRO-3 and
dp=2,tp=2, under both executors. --lora-base-dtype int8 (models/int8.py, the same machinery):
its round trip's error bound, its base's storage and planner bytes, and one step of it."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import family, int8, llama, lora, nf4
from spmd import lora_base, plan
from spmd.engine import precision
from spmd.engine.options import StepOptions
from spmd.engine.state_layout import sharded_bytes
from spmd.engine.step import Program
from spmd.errors import UsageError
from spmd.estimate import cost, memory
from spmd.estimate import lora as lora_estimate
from spmd.parallel.mesh import parse_mesh
from spmd.run import builder, weights
from spmd.run.config import build, flat, preset
from spmd.sections import Config, LoraConfig
from tests import trainer

# bitsandbytes' NF4 code book as published (functional.py, get_4bit_type("nf4"); the QLoRA
# paper's appendix E), written out here rather than read from the module under test
PUBLISHED = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]
STEPS, BATCH, SEQ_LEN = 6, 8, 16
QLORA = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_base_dtype="nf4")
PLAIN = dataclasses.replace(QLORA, lora_base_dtype="")
INT8 = dataclasses.replace(QLORA, lora_base_dtype="int8")


def test_nf4_is_bitsandbytes_code_book_and_block_rule():
    """A tensor of 3 blocks of 64 whose codes are chosen: each block holds its absmax (+-s) and
    values a known code's value times s moved by less than half the gap to its neighbours;
    bitsandbytes' rule (absmax per 64 consecutive values, the nearest code, two codes a byte,
    the first in the high nibble) gives these bytes and scales, and dequantizing gives each
    code's value times its block's absmax."""
    assert list(nf4.CODE) == PUBLISHED and nf4.BLOCK == 64
    rng = np.random.default_rng(0)
    code = np.asarray(PUBLISHED)
    gaps = np.diff(code)
    absmax = np.asarray([0.5, 3.0, 1e-3])
    index = rng.integers(0, 16, size=(3, 64))
    index[:, 0] = [15, 0, 15]  # the block's absmax itself: +s, -s, +s
    room = np.minimum(np.r_[gaps[0], gaps][index], np.r_[gaps, gaps[-1]][index]) * 0.45
    jitter = rng.uniform(-1, 1, size=index.shape) * room
    jitter[:, 0] = 0.0
    jitter[index == 15] = np.minimum(jitter[index == 15], 0)  # within [-s, s]
    jitter[index == 0] = np.maximum(jitter[index == 0], 0)
    x = ((code[index] + jitter) * absmax[:, None]).reshape(-1).astype(np.float32)
    codes, scales = nf4.quantize_blocks(jnp.asarray(x))
    flat_index = index.reshape(-1)
    expected = (flat_index[0::2] << 4) | flat_index[1::2]
    np.testing.assert_array_equal(np.asarray(codes), expected.astype(np.uint8))
    np.testing.assert_allclose(np.asarray(scales), absmax, rtol=1e-7)
    back = nf4.dequantize_blocks(codes, scales, jnp.float32)
    want = (code[index] * absmax[:, None]).reshape(-1)
    np.testing.assert_allclose(np.asarray(back), want, rtol=1e-6, atol=1e-12)
    # along a dim (a block matrix's embed), the scales kept as their fp32 bits
    w = jnp.asarray(x.reshape(3, 64).T)  # embed (64) first, as wq [embed, ...]
    c, bits = nf4.quantize(w, 0)
    assert c.shape == (32, 3) and c.dtype == jnp.uint8 and bits.dtype == jnp.uint32
    np.testing.assert_allclose(
        np.asarray(nf4.dequantize(c, bits, 0, jnp.float32)), want.reshape(3, 64).T, rtol=1e-6
    )


def test_int8_round_trip_is_within_half_a_step_and_exact_on_its_multiples():
    """int8 blocks of 64 along embed: each value back within step / 2 (step = the block's
    absmax / 127), exactly where it is a multiple of the step (power-of-two steps: every
    product exact in fp32); the codes int8 of the weight's shape, the steps' fp32 bits."""
    assert int8.BLOCK == nf4.BLOCK == 64
    rng = np.random.default_rng(0)
    absmax = np.asarray([0.5, 3.0, 1e-3], np.float32)
    x = rng.uniform(-1, 1, size=(3, 64)).astype(np.float32) * absmax[:, None]
    x[:, 0] = absmax  # each block's absmax itself
    w = jnp.asarray(x.T)  # embed (64) first, as wq [embed, ...]
    codes, bits = nf4.quantize(w, 0, "int8")
    assert codes.shape == (64, 3) and codes.dtype == jnp.int8 and bits.shape == (1, 3)
    back = np.asarray(nf4.dequantize(codes, bits, 0, jnp.float32, "int8")).T
    assert np.all(np.abs(back - x) <= absmax[:, None] / 127 / 2 * (1 + 1e-6))
    steps = np.asarray([2.0**-7, 2.0**-2, 2.0**-15], np.float32)
    k = rng.integers(-127, 128, size=(3, 64))
    k[:, 0] = 127
    exact = (k * steps[:, None]).astype(np.float32)
    q, step = int8.quantize_blocks(jnp.asarray(exact))
    np.testing.assert_array_equal(np.asarray(q), k.astype(np.int8))
    np.testing.assert_array_equal(np.asarray(int8.dequantize_blocks(q, step, jnp.float32)), exact)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantized_base_needs_lora_and_names_the_valid_values(kind):
    table = lora.DENSE
    with pytest.raises(UsageError, match=f"--lora-base-dtype {kind} .* needs --lora-rank > 0"):
        lora.spec_of(table, tuple(table), "llama", 0, 0.0, 0.0, "", kind)
    with pytest.raises(UsageError, match="'int4' is not a base storage; valid: nf4 .*, int8"):
        lora.spec_of(table, tuple(table), "llama", 4, 0.0, 0.0, "", "int4")


def program(
    lora_cfg: LoraConfig, mesh: str = "dp=1", executor: str = "auto", remat: str = "none"
) -> Program:
    """The tiny Llama (2 layers) under `lora_cfg` on `mesh`; remat other than none with the
    explicit executor runs ZeRO-3's prefetching layer scan (spmd.parallel.layer_scan)."""
    cfg = dataclasses.replace(trainer.tiny_config(), n_layers=2, remat=remat)
    train = flat(None, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, warmup=1, lr=1e-2)
    spec = builder.model_spec(cfg, precision.POLICIES["fp32"], builder.lora_spec(cfg, lora_cfg))
    options = StepOptions(executor=executor, prefetch=remat != "none")
    lay = trainer.layout(mesh, 3)
    built = builder.build(spec, builder.optimizer(train), lay, options, None, BATCH, SEQ_LEN)
    assert isinstance(built, Program)
    return built


def run(prog: Program, initial: tuple) -> np.ndarray:
    metrics, _ = trainer.train_metrics(prog, STEPS, initial, batch=BATCH, seq_len=SEQ_LEN)
    return metrics["loss"]


@functools.cache
def reference() -> tuple[tuple, np.ndarray]:
    """The QLoRA init (host arrays) and the losses of LoRA on its dequantized base (one
    device): the function QLoRA trains, held in fp32."""
    prog = program(QLORA)
    initial = jax.device_get(tuple(prog.init()))
    model: Any = prog.model(initial[0])  # a LoraModel on the NF4 base
    base = nnx.to_pure_dict(nnx.state(nf4.dequantized(model.frozen, list(model.quantized))))
    plain = program(PLAIN)
    params = {**initial[0], "frozen": jax.device_get(base)}
    state = jax.device_get(tuple(plain.start(params)))
    return initial, run(plain, state)


def test_the_base_is_held_as_4_bit_codes_sharded_like_its_weights():
    prog = program(QLORA, "fsdp=2")
    wq = prog.abstract_params["frozen"]["blocks"]["attn"]["wq"]
    scales = prog.abstract_params["frozen"]["blocks"]["attn"]["wq_nf4"]["scales"]
    assert wq.dtype == jnp.uint8 and wq.shape == (2, 32, 8, 8)  # embed 64 -> 32 bytes
    assert scales.dtype == jnp.uint32 and scales.shape == (2, 1, 8, 8)
    names = prog.names["frozen"]["blocks"]["attn"]
    assert names["wq"] == ("layers", "embed", "heads", "head_dim")
    assert names["wq_nf4"]["scales"] == ("layers", None, "heads", "head_dim")
    assert "fsdp" in str(wq.sharding.spec)  # ZeRO-3 stores the 4-bit blocks split
    # the token table (the tied head) too, along its embed dim
    embed = prog.abstract_params["frozen"]["embed"]
    assert embed.dtype == jnp.uint8 and embed.shape == (256, 32)
    # adapters (trained) stay fp32, the norms and embedding in the working dtype
    assert prog.abstract_params["lora"]["q"]["a"].dtype == jnp.float32


def test_the_int8_base_is_held_as_int8_codes_sharded_like_its_weights():
    prog = program(INT8, "fsdp=2")
    attn = prog.abstract_params["frozen"]["blocks"]["attn"]
    assert attn["wq"].dtype == jnp.int8 and attn["wq"].shape == (2, 64, 8, 8)  # embed whole
    assert attn["wq_int8"]["scales"].dtype == jnp.uint32
    assert attn["wq_int8"]["scales"].shape == (2, 1, 8, 8)
    assert prog.names["frozen"]["blocks"]["attn"]["wq"] == ("layers", "embed", "heads", "head_dim")
    assert "fsdp" in str(attn["wq"].sharding.spec)
    assert prog.abstract_params["frozen"]["embed"].dtype == jnp.int8


def test_one_int8_step_runs_and_starts_at_the_plain_bases_loss():
    """One step on the int8 base (B at zeros: the first loss is the base's) within 1e-2 of
    LoRA's on the same base unquantized: the same seed draws the same base."""
    plain, quantized = program(PLAIN), program(INT8)
    want, _ = trainer.train_metrics(plain, 1, batch=BATCH, seq_len=SEQ_LEN)
    got, _ = trainer.train_metrics(quantized, 1, batch=BATCH, seq_len=SEQ_LEN)
    assert np.isfinite(got["loss"]).all()
    assert abs(float(got["loss"][0]) - float(want["loss"][0])) < 1e-2, (got, want)


@pytest.mark.parametrize(
    "mesh,executor,remat",
    [
        ("fsdp=2", "auto", "none"),
        ("fsdp=2", "explicit", "full"),  # the prefetching scan: no cotangent for the codes
        ("dp=2,tp=2", "auto", "none"),
        ("dp=2,tp=2", "explicit", "none"),
    ],
)
def test_qlora_trains_as_lora_on_the_dequantized_base(mesh, executor, remat):
    initial, want = reference()
    got = run(program(QLORA, mesh, executor, remat), initial)
    assert got[-1] < got[0] - 0.1, got  # it learns
    np.testing.assert_allclose(got, want, rtol=2e-5)


def base_bytes(lora_cfg: LoraConfig) -> int:
    """The bytes of the 1b preset's frozen base as a LoRA program holds it (bf16 policy, one
    device): what the dry run's compiled argument bytes count for it (its figures match the
    abstract state's to the byte: the dry run's 'expected' column)."""
    cfg = build(llama.LlamaConfig, preset("1b"), "1b preset")
    bf16 = precision.POLICIES["bf16"]
    spec = builder.model_spec(cfg, bf16, builder.lora_spec(cfg, lora_cfg))
    train = flat(None, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, warmup=1, lr=1e-2)
    lay, options = trainer.layout("dp=1", 3), StepOptions(policy=bf16)
    prog = builder.build(spec, builder.optimizer(train), lay, options, None, 8, 2048)
    assert isinstance(prog, Program)
    leaves = jax.tree.leaves(prog.abstract_params["frozen"])
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)


def test_the_1b_base_takes_at_most_0_32_of_bf16s_bytes():
    """Issue 60's QLoRA memory oracle: --lora-rank 16 --lora-base-dtype nf4 on the 1b preset
    holds the base in at most 0.32x the bytes of a bf16 base (0.28x: 0.5625 B/param for every
    matrix, the norms in bf16)."""
    rank16 = LoraConfig(lora_rank=16)
    ratio = base_bytes(dataclasses.replace(rank16, lora_base_dtype="nf4")) / base_bytes(rank16)
    assert 0.27 < ratio <= 0.32, ratio


def test_the_planners_1b_int8_base_is_between_nf4s_and_bf16s():
    """spmd.estimate.memory.frozen_base_bytes on the 1b preset (bf16, one device): int8's
    1 + 1/16 B/param between nf4's 0.5625 and bf16's 2, 0.53x bf16's; the planner's code
    bytes are the formats' (a byte per code element, nf4 two values to one)."""
    assert lora_estimate.CODE_BYTES == {k: 1 / f.packing for k, f in nf4.FORMATS.items()}
    cfg = build(llama.LlamaConfig, preset("1b"), "1b preset")
    base = {}
    for kind in ("", "nf4", "int8"):
        fields = lora_base.planner_fields(cfg, LoraConfig(lora_rank=16, lora_base_dtype=kind))
        s = cost.Setup(
            shape=cfg.shape(),
            n_params=cfg.n_params(),
            mesh=parse_mesh("dp=1"),
            zero=1,
            precision="bf16",
            optimizer="adamw",
            batch=8,
            seq_len=2048,
            **fields,
        )
        base[kind] = memory.frozen_base_bytes(s, 2)
    assert base["nf4"] < base["int8"] < base[""]
    assert base["int8"] / base[""] == pytest.approx((1 + 4 / 64) / 2, rel=1e-6)


@pytest.mark.parametrize("qlora", [QLORA, INT8], ids=["nf4", "int8"])
def test_the_planner_counts_the_quantized_base_as_the_engine_holds_it(qlora):
    """spmd.estimate.memory.frozen_base_bytes against the engine's shardings of the tiny
    preset's QLoRA state, ZeRO-1 and -3 (the codes split over fsdp, the scales not); within
    1%: the planner counts the norms as quantized, 0.6% of tiny's bytes (the 1b preset's
    dry run: 684.54 MiB compiled, 684.45 planned)."""
    model = trainer.tiny_config()
    fields = lora_base.planner_fields(model, qlora)
    for mesh, zero in [("dp=2,fsdp=4", 1), ("dp=2,fsdp=2,tp=2", 3)]:
        s = cost.Setup(
            shape=model.shape(),
            n_params=model.n_params(),
            mesh=parse_mesh(mesh),
            zero=zero,
            precision="bf16",
            optimizer="adamw",
            batch=16,
            seq_len=64,
            **fields,
        )
        program, _ = plan.engine_program(
            s, model, jax.devices()[:8], Config(model=model, lora=qlora)
        )
        held = sharded_bytes(program.abstract_params)
        assert held == pytest.approx(memory.model_state_bytes(s)["params"], rel=1e-2), mesh


def test_merged_is_the_adapted_model_on_the_dequantized_base():
    """--to-hf's model (LoraModel.merged): the base's weights dequantized, the adapters merged
    in, no NF4 codes left, and the logits of the model QLoRA trained (eager, no compile)."""
    cfg = dataclasses.replace(trainer.tiny_config(), n_layers=1)
    spec = builder.lora_spec(cfg, QLORA)
    assert spec is not None
    model: Any = builder.model_spec(cfg, precision.POLICIES["fp32"], spec).make(0)
    for adapter in model.lora.values():  # B starts at zeros: make the merge count
        for b in adapter["b"].values():
            b[...] = jax.random.normal(jax.random.key(1), b[...].shape) * 0.1
    graphdef, params = nnx.split(model)
    merged_state = jax.eval_shape(lambda p: nnx.state(nnx.merge(graphdef, p).merged()), params)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(merged_state))
    assert not any(nf4.SUFFIX in jax.tree_util.keystr(path) for path, _ in leaves)
    assert all(x.dtype == jnp.float32 for _, x in leaves)

    @jax.jit
    def both(p: Any, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        qlora = nnx.merge(graphdef, p)
        return qlora.merged()(tokens), qlora(tokens)

    merged, trained = both(params, jnp.asarray(np.arange(32).reshape(2, 16) % cfg.vocab_size))
    np.testing.assert_allclose(merged, trained, rtol=1e-4, atol=1e-5)


def test_a_resume_without_the_nf4_flag_exits_2_naming_it():
    """A QLoRA checkpoint's codes are not a working-dtype base's weights: a resume with
    another --lora-base-dtype is refused naming the flags that resume it (no param path)."""
    model = trainer.tiny_config()
    saved = Config(model=model, lora=QLORA).as_dict()
    with pytest.raises(UsageError, match=r"an nf4 base; .* --lora-alpha 8 --lora-base-dtype nf4$"):
        lora_base.check_settings(Config(model=model, lora=PLAIN), saved, "step 4")
    lora_base.check_settings(Config(model=model, lora=QLORA), saved, "step 4")  # the same: ok


def test_an_hf_base_is_quantized_as_it_loads(tmp_path):
    """--init-from-hf with nf4: the folder's weights loaded in fp32, then quantized in the
    program's shardings (fsdp=2 ZeRO-3): the codes and scales are nf4.quantize's of the
    folder's weights, the norms the folder's own."""
    cfg = dataclasses.replace(trainer.tiny_config(), n_layers=2)
    base = jax.device_get(nnx.to_pure_dict(nnx.state(llama.create(cfg, 7))))
    family.save_hf(base, cfg, str(tmp_path), max_positions=64)
    prog = program(QLORA, "fsdp=2")
    params = jax.device_get(weights.init_from_hf(str(tmp_path), prog)[0])["frozen"]
    codes, bits = nf4.quantize(jnp.asarray(base["blocks"]["mlp"]["w_down"]), 2)
    np.testing.assert_array_equal(params["blocks"]["mlp"]["w_down"], codes)
    np.testing.assert_array_equal(params["blocks"]["mlp"]["w_down_nf4"]["scales"], bits)
    table, _ = nf4.quantize(jnp.asarray(base["embed"]), 1)
    np.testing.assert_array_equal(params["embed"], table)
    np.testing.assert_array_equal(params["final_norm"]["scale"], base["final_norm"]["scale"])
