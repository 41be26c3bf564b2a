"""LoRA with dropout on the adapters' input (models/adapter.py) and on the layouts
tests/test_lora.py leaves out: the masks are deterministic, the same on every layout and new
at each optimizer step, dropout changes the gradients but not the eval loss, and context
parallelism, tensor parallelism with sequence parallelism, expert parallelism and pipelines
train as one device does."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from models import family, finetune, llama, moe
from spmd.engine import precision
from spmd.engine.options import StepOptions
from spmd.engine.step import Program
from spmd.parallel import traced_layout
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import build_mesh, parse_mesh
from spmd.parallel.pipeline import Pipeline
from spmd.run import builder
from spmd.run.config import build, flat, preset
from spmd.sections import LoraConfig
from tests import trainer

STEPS, BATCH, SEQ_LEN = 3, 8, 16
DROPOUT = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.5)


@functools.cache
def model_cfg(name: str) -> Any:
    if name == "moe":
        cfg = build(moe.MoEConfig, preset("moe-tiny"), "moe-tiny preset")
        return dataclasses.replace(cfg, n_layers=1)  # one layer compiles in half the time
    if name == "dense4":  # pp=2 x 2 chunks per stage (interleaved)
        return dataclasses.replace(trainer.tiny_config(), n_layers=4)
    return dataclasses.replace(trainer.tiny_config(), n_layers=2)


def program(
    model: str,
    mesh: str = "dp=1",
    executor: str = "auto",
    sp: bool = False,
    lora: LoraConfig = DROPOUT,
    pp: tuple[str, int] | None = None,
) -> Program:
    cfg = model_cfg(model)
    train = flat(None, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, warmup=1, lr=1e-2)
    spec = builder.model_spec(cfg, precision.POLICIES["fp32"], builder.lora_spec(cfg, lora))
    sizes = parse_mesh(mesh)
    devices = jax.devices()[: int(np.prod(list(sizes.values())))]
    lay = Layout(build_mesh(sizes, devices), 3, sequence_parallel=sp)
    pipe = Pipeline(pp[0], 2, pp[1], llama.logits_loss) if pp else None  # (schedule, virtual)
    options = StepOptions(executor=executor, pipeline=pipe)
    built = builder.build(spec, builder.optimizer(train), lay, options, None, BATCH, SEQ_LEN)
    assert isinstance(built, Program)
    return built


def train(prog: Program, initial: tuple) -> tuple[np.ndarray, np.ndarray, dict]:
    """(losses, grad norms) of STEPS steps from `initial`, and the final params (numpy)."""
    metrics, params = trainer.train_metrics(prog, STEPS, initial, batch=BATCH, seq_len=SEQ_LEN)
    return metrics["loss"], metrics["grad_norm"], params


@functools.cache
def one_device(model: str) -> tuple[Program, tuple, tuple]:
    """The one-device program with dropout, its initial state and its run."""
    prog = program(model)
    initial = jax.device_get(tuple(prog.init()))
    return prog, initial, train(prog, initial)


def test_dropout_is_deterministic():
    prog, initial, (losses, norms, _) = one_device("dense")
    again = train(prog, initial)  # the same seed and batches: the same masks
    assert np.array_equal(again[0], losses) and np.array_equal(again[1], norms)


def test_dropout_changes_the_gradients_but_not_the_eval():
    prog, (params, _, _), _ = one_device("dense")
    params, batch = jax.tree.map(np.array, params), trainer_batch()
    for adapter in params["lora"].values():  # B != 0: the adapters move the logits
        for name, b in adapter["b"].items():
            adapter["b"][name] = 0.1 * jax.random.normal(jax.random.key(1), b.shape)
    model = prog.model(params)
    graphdefs = [prog.graphdef]
    model.rate = 0.0  # the same model without dropout
    graphdefs.append(nnx.graphdef(model))
    loss_fn = finetune.lora_loss(family.LLAMA.loss)

    def losses(p: dict) -> tuple:
        def loss(graphdef: Any) -> Any:  # of the adapters, the base held fixed
            return lambda lora: loss_fn(nnx.merge(graphdef, {**p, "lora": lora}), batch)

        with traced_layout.training():
            trained = [jax.value_and_grad(loss(g))(p["lora"]) for g in graphdefs]
        return trained, loss(graphdefs[0])(p["lora"])

    ((_, dropped), (plain_loss, plain)), eval_loss = jax.jit(losses)(params)
    for a, b in zip(jax.tree.leaves(dropped), jax.tree.leaves(plain), strict=True):
        assert np.max(np.abs(a - b)) > 1e-3 * np.max(np.abs(b))  # every adapter's gradient
    assert eval_loss == plain_loss  # eval runs without dropout, as peft's model.eval()


def test_each_optimizer_step_draws_new_masks():
    """The masks hash in the optimizer state's update count: the same params and batch one
    step later drop other elements (a window seen again in a later epoch), the same step the
    same ones (a resume)."""
    prog, (params, opt_state, loss_scale), _ = one_device("dense")
    batch = jax.device_put(trainer_batch(), prog.layout.batch_sharding())

    def grad_norm_at(count: int) -> float:  # B's gradient sees the dropped x A (B = 0 yet)
        state = jax.tree_util.tree_map_with_path(
            lambda path, x: x + count if jax.tree_util.keystr(path).endswith(".count") else x,
            opt_state,
        )
        return float(prog.train_step(params, state, loss_scale, batch)[-1]["grad_norm"])

    assert grad_norm_at(0) == grad_norm_at(0) != grad_norm_at(1)


def trainer_batch() -> dict:
    win = trainer.windows(SEQ_LEN)
    return win.batch_rows(np.arange(BATCH))


LAYOUTS = [
    # context, tensor (with sequence parallelism) and fsdp ZeRO-3, by hand
    ("dense", "fsdp=2,cp=2,tp=2", "explicit", True),
    ("moe", "dp=2,ep=2", "auto", False),  # the experts (not adapted) split in two
]


@pytest.mark.parametrize("model,mesh,executor,sp", LAYOUTS)
def test_lora_with_dropout_on_a_layout_equals_one_device(model, mesh, executor, sp):
    _, initial, (want_losses, want_norms, want) = one_device(model)
    losses, norms, got = train(program(model, mesh, executor, sp), initial)
    assert np.max(np.abs(losses - want_losses)) < 1e-5
    assert np.max(np.abs(norms - want_norms)) < 1e-5
    for a, b in zip(jax.tree.leaves(got["lora"]), jax.tree.leaves(want["lora"]), strict=True):
        assert np.max(np.abs(a - b)) < 1e-5


PIPELINES = [  # (model, mesh, executor, schedule, chunks per stage)
    ("dense", "dp=2,pp=2", "explicit", "1f1b", 1),
    ("dense", "cp=2,pp=2", "auto", "1f1b", 1),  # the stage manual over context: rows in chunks
    ("dense4", "pp=2", "auto", "interleaved", 2),  # stage s, chunk k: layers of chunk k p + s
]


@pytest.mark.parametrize("model,mesh,executor,schedule,chunks", PIPELINES)
def test_lora_with_dropout_in_a_pipeline_equals_one_device(model, mesh, executor, schedule, chunks):
    """Each stage runs its chunk of the layers with their global indices (hooks.first_layer)
    on its micro-batch's tokens (hooks.chunk_inputs), so the masks are one device's: with the
    chunk's own indices, stage 1's layers would draw stage 0's masks."""
    _, initial, (want_losses, want_norms, want) = one_device(model)
    prog = program(model, mesh, executor, pp=(schedule, chunks))
    losses, norms, got = train(prog, initial)
    assert np.max(np.abs(losses - want_losses)) < 1e-5
    assert np.max(np.abs(norms - want_norms)) < 1e-5
    for a, b in zip(jax.tree.leaves(got["lora"]), jax.tree.leaves(want["lora"]), strict=True):
        assert np.max(np.abs(a - b)) < 1e-5


PHI3 = Path(__file__).resolve().parent / "fixtures" / "hf_phi3"


def test_adapters_beside_the_matmuls_give_the_merged_models_logits():
    """x W + s x A B (the training form) against x (W + s A B) (the merged export's), B != 0,
    on Phi-3's fused q,k,v and gate,up (one A each, as peft's). Gemma 2's and OLMo 2's
    projections, checked so by hand: within 1e-5 too (docs/strategies/lora.md)."""
    checkpoint = family.open_hf(str(PHI3))
    cfg, fam = checkpoint.config, family.get(checkpoint.family)
    spec = finetune.lora_spec(fam, 4, 8.0, 0.0, "")
    assert spec is not None

    def make() -> Any:
        model = finetune.with_lora(fam.create(cfg, 0, np.float32), spec, fam.hf.tensors, 0)
        pure = nnx.to_pure_dict(nnx.state(model))
        for i, adapter in enumerate(pure["lora"].values()):  # B != 0
            for key, b in adapter["b"].items():
                adapter["b"][key] = 0.1 * jax.random.normal(jax.random.key(i), b.shape)
        return pure

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: finetune.with_lora(
        fam.create(cfg, 0, np.float32), spec, fam.hf.tensors, 0)))  # fmt: skip
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16) % cfg.vocab_size

    def logits() -> tuple:
        lora = nnx.merge(graphdef, make())
        return lora(tokens), lora.merged()(tokens), lora.frozen(tokens)

    beside, merged, base = jax.jit(logits)()
    assert np.max(np.abs(beside - base)) > 1e-2  # the adapters matter
    assert np.max(np.abs(beside - merged)) < 1e-5
