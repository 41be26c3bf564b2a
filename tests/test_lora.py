"""LoRA (models/lora.py, spmd.engine.frozen): the adapters start as the base model exactly,
train equally on every layout and under both executors, keep no gradients or optimizer state
for the frozen base, and refuse bad flags with one line."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from models import family, finetune, llama
from models import peft as models_peft
from spmd.engine import frozen, precision
from spmd.engine.options import StepOptions
from spmd.engine.step import Program
from spmd.errors import UsageError
from spmd.io import safetensors_io
from spmd.parallel.pipeline import Pipeline
from spmd.run import builder, weights
from spmd.run.config import flat
from spmd.sections import LoraConfig
from tests import cli, trainer

STEPS, BATCH, SEQ_LEN = 10, 8, 16
LORA = LoraConfig(lora_rank=4, lora_alpha=8.0)


@functools.cache
def model_cfg() -> llama.LlamaConfig:
    return dataclasses.replace(trainer.tiny_config(), n_layers=2)


def program(mesh: str, zero: int = 3, executor: str = "auto", pp: bool = False) -> Program:
    cfg = model_cfg()
    train = flat(None, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, warmup=2, lr=1e-2)
    spec = builder.model_spec(cfg, precision.POLICIES["fp32"], builder.lora_spec(cfg, LORA))
    pipe = Pipeline("1f1b", 2, 1, llama.logits_loss) if pp else None
    options = StepOptions(executor=executor, pipeline=pipe)
    lay = trainer.layout(mesh, zero)
    built = builder.build(spec, builder.optimizer(train), lay, options, None, BATCH, SEQ_LEN)
    assert isinstance(built, Program)
    return built


@functools.cache
def one_device() -> tuple[Program, tuple]:
    prog = program("dp=1")
    return prog, jax.device_get(tuple(prog.init()))


def train(prog: Program, initial: tuple) -> tuple[np.ndarray, dict]:
    """Losses of STEPS steps from `initial` and the final params (numpy)."""
    return trainer.train_losses(prog, STEPS, initial, batch=BATCH, seq_len=SEQ_LEN)


@functools.cache
def one_device_run() -> tuple[np.ndarray, dict]:
    return train(*one_device())


def both_logits(prog: Program, params: dict, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
    """(the LoRA model's logits, its frozen base's alone) of `tokens`, in one jit."""

    def forward(p: dict) -> tuple:
        model = prog.model(p)
        return model(tokens), model.frozen(tokens)

    return tuple(np.asarray(x) for x in jax.jit(forward)(params))


def test_zero_b_gives_the_base_models_logits_exactly():
    prog, (params, _, _) = one_device()
    tokens = np.arange(2 * SEQ_LEN, dtype=np.int32).reshape(2, SEQ_LEN) % 256
    lora_logits, base_logits = both_logits(prog, params, tokens)
    assert np.array_equal(lora_logits, base_logits)
    # A is peft's kaiming-uniform, B zero: the adapters are there, and they are not trivial
    q = params["lora"]["q"]
    bound = 1 / np.sqrt(model_cfg().embed_dim)
    assert 0.5 * bound < np.abs(q["a"]).max() <= bound and not np.any(q["b"]["wq"])


def test_the_base_has_no_gradients_and_no_optimizer_state():
    prog, (params, opt_state, _) = one_device()
    adapters = sum(x.size for x in jax.tree.leaves(frozen.trainable(params)))
    base = sum(x.size for x in jax.tree.leaves(params["frozen"]))
    state = sum(x.size for x in jax.tree.leaves(opt_state))
    assert adapters < base / 10
    assert state <= 2 * adapters + 8  # AdamW's m and v of the adapters, and its counts
    losses, final = one_device_run()
    assert losses[-1] < losses[0] - 0.05  # the adapters learn
    for before, after in zip(
        jax.tree.leaves(params["frozen"]), jax.tree.leaves(final["frozen"]), strict=True
    ):
        assert np.array_equal(before, after)


LAYOUTS = [
    ("dp=2,fsdp=2,tp=2", 3, "auto", False),
    ("fsdp=4", 3, "auto", False),
    ("pp=2", 1, "auto", True),
]  # the explicit executor: tests/test_lora_layouts.py (fsdp=2,cp=2,tp=2 with SP, dropout)


@pytest.mark.parametrize("mesh,zero,executor,pp", LAYOUTS)
def test_lora_training_on_a_layout_equals_one_device(mesh, zero, executor, pp):
    want_losses, want = one_device_run()
    losses, got = train(program(mesh, zero, executor, pp), one_device()[1])
    assert np.max(np.abs(losses - want_losses)) < 1e-5
    for a, b in zip(jax.tree.leaves(got["lora"]), jax.tree.leaves(want["lora"]), strict=True):
        assert np.max(np.abs(a - b)) < 1e-5


def test_a_checkpoint_view_restores_the_state_bitwise():
    prog, initial = one_device()
    state = prog.init()
    view = jax.device_get(prog.checkpoint_view(state))
    restored = jax.device_get(tuple(prog.from_checkpoint(view)))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(initial), strict=True):
        assert np.array_equal(a, b)


BAD = [
    (dict(lora_rank=-1), "--lora-rank -1"),
    (dict(lora_rank=0, lora_targets="q"), "needs --lora-rank"),
    (dict(lora_rank=4, lora_alpha=-1.0), "--lora-alpha -1.0"),
    (dict(lora_rank=4, lora_alpha=float("inf")), "--lora-alpha inf"),
    (dict(lora_rank=4, lora_dropout=1.0), "--lora-dropout 1.0"),
    (dict(lora_rank=4, lora_dropout=-0.1), "--lora-dropout -0.1"),
    (dict(lora_rank=4, lora_targets="q,qkv"), "valid: q, k, v, o, gate, up, down"),
]


@pytest.mark.parametrize("fields,named", BAD)
def test_bad_lora_flags_exit_2_in_one_line(fields, named):
    with pytest.raises(UsageError) as err:
        builder.lora_spec(model_cfg(), LoraConfig(**fields))
    assert named in str(err.value) and "\n" not in str(err.value)


def test_every_family_declares_targets_and_a_default_among_them():
    for fam in family.FAMILIES.values():
        assert fam.lora_default and set(fam.lora_default) <= set(fam.lora_targets), fam.name
    phi3 = family.get("phi3").lora_targets
    assert len(phi3["qkv"]) == 3  # one adapter on the fused projection, as peft's
    moe = family.get("moe").lora_targets
    assert set(moe) == {"q", "k", "v", "o"}  # experts are not targets


def test_an_moe_lora_run_logs_the_router_statistics_of_the_adapted_model(tmp_path):
    """issue 55: a logged step's router statistics ran on the LoraModel, which has no MoE
    `forward`: every MoE LoRA run crashed at its first logged step, before any save."""
    metrics = tmp_path / "metrics.jsonl"
    args = ["--model", "moe-tiny", "--lora-rank", "4", "--mesh", "dp=1", "--steps", "2"]
    args += ["--log-every", "1"]
    args += ["--batch", "4", "--seq-len", "16", "--eval-fraction", "0", "--metrics", str(metrics)]
    done = cli.train_in_process(*args)
    assert done.returncode == 0, done.stderr
    logged = [r for r in cli.records(metrics) if r["kind"] == "train"]
    assert len(logged) == 2 and all(np.isfinite(r["aux_loss"]) for r in logged)


# --- Hugging Face: the fixture as the base, merged export, peft's format ----------------

UNTIED = Path(__file__).resolve().parent / "fixtures" / "hf_llama_untied"


@functools.cache
def fixture_run() -> tuple[Program, dict]:
    """A LoRA program on the untied Llama fixture, started from its weights, after 3 steps on
    one batch of random tokens (so B is no longer zero), and its params (on the device)."""
    cfg = family.open_hf(str(UNTIED)).config
    adapters = builder.lora_spec(cfg, LORA)
    train = flat(None, steps=3, batch=8, seq_len=16, warmup=1, lr=1e-2)
    spec = builder.model_spec(cfg, precision.POLICIES["fp32"], adapters)
    prog = builder.build(spec, builder.optimizer(train), trainer.layout("dp=1"), StepOptions())
    assert isinstance(prog, Program)
    state = weights.init_from_hf(str(UNTIED), prog)
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 17), np.int32)
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    for _ in range(3):
        *state, _ = prog.train_step(*state, batch)
    return prog, state[0]


def test_the_merged_export_gives_the_lora_models_logits(tmp_path):
    prog, params = fixture_run()
    base = builder.model_program(prog.model(params).cfg, prog.layout)
    merged = weights.merge_lora(prog, base, params)
    family.save_hf(jax.device_get(merged), base.model(merged).cfg, str(tmp_path / "hf"))
    exported = weights.from_hf(str(tmp_path / "hf"), prog.layout)
    tokens = np.random.default_rng(1).integers(0, 128, (2, 16), np.int32)
    want, base_logits = both_logits(prog, params, tokens)
    got = np.asarray(jax.jit(lambda p: exported.program.model(p)(tokens))(exported.params))
    assert np.max(np.abs(got - want)) < 1e-5
    assert np.max(np.abs(want - base_logits)) > 1e-3  # the adapters changed the model


def test_the_peft_export_has_peft_names_and_reads_back(tmp_path):
    prog, params = fixture_run()
    cfg, adapters = prog.model(params).cfg, jax.device_get(params["lora"])
    spec = builder.lora_spec(cfg, LORA)
    folder = tmp_path / "peft"
    finetune.save_peft(adapters, spec, cfg, str(folder), "org/base")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["base_model_name_or_path"] == "org/base"
    assert set(config["target_modules"]) == {f"{t}_proj" for t in spec.targets}
    found, _ = safetensors_io.read_header(folder / "adapter_model.safetensors")
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    assert found[f"{q}.lora_A.weight"].shape == (4, cfg.embed_dim)
    assert found[f"{q}.lora_B.weight"].shape == (cfg.n_heads * cfg.head_dim, 4)
    assert len(found) == 2 * cfg.n_layers * len(spec.targets)
    back = models_peft.load(str(folder), spec, family.get("llama").hf.tensors, adapters)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(adapters), strict=True):
        assert np.array_equal(a, b)


def test_under_bf16_the_base_is_held_in_bf16_only_and_the_adapters_have_an_fp32_master():
    cfg = model_cfg()
    policy = precision.POLICIES["bf16"]
    spec = builder.model_spec(cfg, policy, builder.lora_spec(cfg, LORA))
    train = flat(None, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, warmup=2, lr=1e-2)
    options = StepOptions(policy=policy)
    prog = builder.build(spec, builder.optimizer(train), trainer.layout("dp=1"), options)
    assert isinstance(prog, Program)
    base = jax.tree.leaves(prog.abstract_params["frozen"])
    assert {x.dtype for x in base} == {np.dtype("bfloat16")}
    master = prog.abstract_opt_state["master"]
    assert set(master) == {"lora"}  # no fp32 copy of the base
    assert {x.dtype for x in jax.tree.leaves(master)} == {np.dtype("float32")}
