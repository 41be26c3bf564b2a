"""`--init-from-peft DIR` (models/peft.py, spmd.run.resolve, spmd.run.weights): an adapter
that peft itself wrote (tests/fixtures/peft_llama, by make_peft_adapter.py onto the untied Llama
fixture) becomes the run's [lora] section and its starting adapters. spmd's LoRA model then gives
peft's logits, a step trains it into an adapter-only checkpoint, and `--to-peft` writes it back
under peft's names. Read with numpy only: no torch or peft here."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from spmd import convert, lora_base, train
from spmd.engine import precision
from spmd.engine.options import StepOptions
from spmd.engine.step import Program
from spmd.io import safetensors_io
from spmd.run import builder, resolve, weights
from spmd.run.config import flat
from tests import trainer

ROOT = Path(__file__).resolve().parents[1]
PEFT = ROOT / "tests" / "fixtures" / "peft_llama"
UNTIED = ROOT / "tests" / "fixtures" / "hf_llama_untied"
LR = 1e-3


def tensors(folder: Path) -> dict[str, np.ndarray]:
    found, _ = safetensors_io.read_header(folder / "adapter_model.safetensors")
    return {name: np.array(info.read()) for name, info in found.items()}


def test_the_adapter_config_names_the_base_and_fills_the_lora_flags(monkeypatch):
    monkeypatch.chdir(ROOT)  # peft wrote base_model_name_or_path relative to the repository
    resolved = resolve.run_config(["--init-from-peft", str(PEFT)], "t")
    assert resolved["run"].init_from_hf == "tests/fixtures/hf_llama_untied"
    lora = resolved["lora"]
    # target_modules o, gate, down, q, v (peft's order) in the family's order; k, up left out
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_dropout) == (4, 8.0, 0.0)
    assert lora.lora_targets == "q,v,o,gate,down"
    # flags that agree (alpha 0 is 2 x rank; targets in any order), and another base named
    agreeing = ["--lora-rank", "4", "--lora-alpha", "0", "--lora-targets", "down,gate,o,v,q"]
    again = resolve.run_config(
        ["--init-from-peft", str(PEFT), "--init-from-hf", str(UNTIED), *agreeing], "t"
    )
    assert again["lora"] == lora and again["run"].init_from_hf == str(UNTIED)
    # dropout is a training choice, not the adapter's weights: the flag given wins
    dropped = resolve.run_config(["--init-from-peft", str(PEFT), "--lora-dropout", "0.1"], "t")
    assert dropped["lora"].lora_dropout == 0.1 and dropped["lora"].lora_rank == 4


def test_the_lora_model_gives_peft_logits():
    resolved = resolve.run_config(
        ["--init-from-peft", str(PEFT), "--init-from-hf", str(UNTIED)], "t"
    )
    cfg, spec = resolved["model"], builder.lora_spec(resolved["model"], resolved["lora"])
    train_cfg = flat(None, steps=1, batch=4, seq_len=16)
    model = builder.model_spec(cfg, precision.POLICIES["fp32"], spec)
    prog = builder.build(model, builder.optimizer(train_cfg), trainer.layout("dp=1"), StepOptions())
    assert isinstance(prog, Program)
    params, _, _ = weights.init_from_hf(str(UNTIED), prog, str(PEFT), spec)
    reference = np.load(PEFT / "reference.npz")
    logits = np.asarray(jax.jit(lambda p: prog.model(p)(reference["input_ids"]))(params))
    assert np.max(np.abs(logits - reference["logits"])) < 1e-5
    assert np.max(np.abs(reference["logits"] - reference["base_logits"])) > 1.0  # it matters


def test_a_step_from_the_adapter_checkpoints_adapters_only_and_exports_peft_names(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(ROOT)  # the base as the adapter names it
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text(" ".join(rng.choice(["ab", "cd ", "efg"], 1000)))
    args = ["--init-from-peft", str(PEFT), "--data", str(tmp_path / "corpus.txt")]
    args += ["--mesh", "fsdp=2", "--steps", "1", "--lr", str(LR), "--warmup", "0"]
    args += ["--lr-schedule", "constant", "--weight-decay", "0", "--batch", "4", "--seq-len", "16"]
    args += ["--eval-fraction", "0", "--checkpoint-every", "1", "--data-cache", str(tmp_path)]
    args += ["--checkpoint-dir", str(tmp_path / "ck"), "--run-dir", "none"]
    assert train.main([*args, "--metrics", str(tmp_path / "m.jsonl")]) == 0
    state = ocp.PyTreeCheckpointHandler().metadata(tmp_path / "ck" / "1" / "state").tree
    assert set(state["params"]) == {"lora"}  # the base is referred to, not saved
    saved = json.loads((tmp_path / "ck" / "1" / "config" / "metadata").read_text())
    assert saved[lora_base.KEY]["sha256"] == lora_base.content_hash(UNTIED)

    out = tmp_path / "peft"
    assert convert.main(["--checkpoint", str(tmp_path / "ck"), "--to-peft", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    original = json.loads((PEFT / "adapter_config.json").read_text())
    for key in ("r", "lora_alpha"):
        assert config[key] == original[key], key
    # the base the adapter named (relative to where the run started), now absolute: peft reads
    # the re-exported adapter from any folder
    assert config["base_model_name_or_path"] == str(ROOT / original["base_model_name_or_path"])
    assert sorted(config["target_modules"]) == sorted(original["target_modules"])
    got, want = tensors(out), tensors(PEFT)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    # one AdamW step moves each value by at most the LR: what was exported is what was loaded
    moved = max(np.max(np.abs(got[k] - want[k])) for k in want)
    assert 0 < moved <= 1.01 * LR, moved
