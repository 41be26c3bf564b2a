"""Adapter-only LoRA checkpoints (spmd.lora_base): a LoRA run onto an --init-from-hf
base saves its adapters, their optimizer state and the base's hash, not the base; resume
reloads the base and is bitwise; `spmd.checkpoint verify` checks the base too; a resume or
export against a base with other weights exits 2 naming both hashes."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from spmd import checkpoint as checkpoint_cli
from spmd import convert, lora_base, train
from spmd.io import checkpoint, manifest, safetensors_io

UNTIED = Path(__file__).resolve().parent / "fixtures" / "hf_llama_untied"


def losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def run_args(work: Path, base: Path, name: str) -> list[str]:
    args = ["--init-from-hf", str(base), "--data", str(work / "corpus.txt"), "--mesh", "fsdp=2"]
    args += ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--steps", "4"]
    args += ["--log-every", "1"]
    args += ["--batch", "4", "--seq-len", "16", "--eval-fraction", "0", "--checkpoint-every", "2"]
    args += ["--data-cache", str(work / "cache"), "--metrics", str(work / f"{name}.jsonl")]
    return [*args, "--checkpoint-dir", str(work / name), "--run-dir", str(work / f"{name}-run")]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A LoRA run of 4 steps onto the untied Llama fixture, checkpoints at steps 2 and 4."""
    work = tmp_path_factory.mktemp("lora_ckpt")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefgh "), 6)) for _ in range(50)]
    (work / "corpus.txt").write_text(" ".join(rng.choice(words, 2000)))
    assert train.main(run_args(work, UNTIED, "full")) == 0
    assert checkpoint.complete_steps(str(work / "full")) == [2, 4]
    return work


@functools.cache
def changed_base(work: Path) -> Path:
    """A copy of the fixture with one weight nudged: same shapes, other weights."""
    folder = work / "changed_base"
    shutil.copytree(UNTIED, folder)
    name = "model-00002-of-00002.safetensors"  # the fixture is in two shards
    tensors, metadata = safetensors_io.read_header(UNTIED / name)
    values = {n: np.array(t.read()) for n, t in tensors.items()}
    first = next(iter(values))
    values[first] = values[first] + np.float32(1e-3)
    entries = [(n, t.shape, t.dtype) for n, t in tensors.items()]
    safetensors_io.write(folder / name, entries, values.__getitem__, metadata)
    return folder


def test_the_checkpoint_holds_adapters_and_a_reference_not_the_base(work):
    state = ocp.PyTreeCheckpointHandler().metadata(work / "full" / "4" / "state").tree
    assert set(state["params"]) == {"lora"}  # no `frozen` subtree
    config = json.loads((work / "full" / "4" / "config" / "metadata").read_text())
    assert config[lora_base.KEY] == {
        "base": str(UNTIED),
        "sha256": lora_base.content_hash(UNTIED),
    }


def test_resume_reloads_the_base_and_is_bitwise(work, capsys):
    resumed = work / "resumed"
    shutil.copytree(work / "full", resumed)
    shutil.rmtree(resumed / "4")
    args = run_args(work, UNTIED, "resumed")
    assert train.main([*args, "--resume", "required"]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    reference, again = losses(work / "full.jsonl"), losses(work / "resumed.jsonl")
    assert sorted(again) == [3, 4]
    assert all(again[s] == reference[s] for s in again), (again, reference)


def test_verify_checks_the_base_and_a_changed_base_fails_it(work, capsys):
    assert checkpoint_cli.main(["verify", str(work / "full")]) == 0
    assert f"base {UNTIED}: sha256 {lora_base.content_hash(UNTIED)[:16]} ok" in (
        capsys.readouterr().out
    )
    moved = work / "moved"
    shutil.copytree(work / "full", moved)
    config = moved / "4" / "config" / "metadata"
    record = json.loads(config.read_text())
    record[lora_base.KEY]["base"] = str(changed_base(work))
    config.write_text(json.dumps(record))
    manifest.write(moved / "4")  # as if the run had been trained on that base
    assert checkpoint_cli.main(["verify", str(moved), "--step", "4"]) == 2
    assert "base differs" in capsys.readouterr().out


def test_a_resume_or_export_against_another_base_exits_2_naming_both_hashes(work, capsys):
    other = changed_base(work)
    found, saved = lora_base.content_hash(other)[:16], lora_base.content_hash(UNTIED)[:16]
    resumed = work / "wrong_base"
    shutil.copytree(work / "full", resumed)
    args = [*run_args(work, other, "wrong_base"), "--steps", "6", "--resume", "required"]
    assert train.main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert found in line and saved in line, line
    # an export reads the base the checkpoint names (unchanged here) back under the adapters
    assert convert.main(["--checkpoint", str(work / "full"), "--to-peft", str(work / "peft")]) == 0
    assert (work / "peft" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize(
    "flags, this_run",
    [
        (["--lora-alpha", "64"], "this run's are rank 4, alpha 64 (scale 16)"),
        (["--lora-rank", "0", "--lora-alpha", "0"], "this run has none (no --lora-rank)"),
        (["--lora-rank", "8"], "this run's are rank 8, alpha 8 (scale 1)"),
    ],
)
def test_a_resume_with_other_lora_settings_exits_2_naming_the_flags(work, capsys, flags, this_run):
    """issue 55: --lora-alpha 64 on a checkpoint trained at 8 resumed (scale 2 -> 16), and one
    without the --lora-* flags was refused naming a param path: each names the saved settings
    and the flags that resume them, and leaves the checkpoint as it was."""
    folder = work / f"settings-{'-'.join(flags)}"
    shutil.copytree(work / "full", folder)
    args = [*run_args(work, UNTIED, folder.name), *flags, "--steps", "6", "--resume", "required"]
    capsys.readouterr()
    assert train.main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    saved = f"the checkpoint at step 4 in {folder} holds LoRA adapters of rank 4, alpha 8 (scale 2)"
    assert saved in line and this_run in line, line
    assert line.endswith("resume it with --lora-rank 4 --lora-alpha 8"), line
    assert checkpoint.complete_steps(str(folder)) == [2, 4]


def test_a_resume_with_another_optimizer_exits_2_naming_the_flag(work, capsys):
    """--optimizer momentum on a checkpoint of AdamW's state: one line naming both and the
    flag that resumes it (not a missing leaf's path), the checkpoint left as it was."""
    folder = work / "other-optimizer"
    shutil.copytree(work / "full", folder)
    args = [*run_args(work, UNTIED, folder.name), "--optimizer", "momentum"]
    capsys.readouterr()
    assert train.main([*args, "--steps", "6", "--resume", "required"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(
        f"the checkpoint at step 4 in {folder} holds the state of --optimizer adamw, not this "
        f"run's momentum; resume it with --optimizer adamw, or start a new run"
    ), line
    assert checkpoint.complete_steps(str(folder)) == [2, 4]
