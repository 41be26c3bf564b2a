"""A full fine-tune's DPO reference (--dpo-reference, spmd.dpo_reference): a frozen copy of the
policy's architecture read from a Hugging Face folder or an spmd checkpoint, sharded as the
policy (fsdp=2 here), an argument of the step with no optimizer state. The loss of a reference
equal to the policy is log 2; a reference that differs gives the loss of the two models'
log-probs (transformers', tests/fixtures/make_preference.py). Runs from the repository root
as a user does."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.cli import records, train_in_process

BASE = "tests/fixtures/hf_llama_untied"
PEFT = "tests/fixtures/peft_llama"
PAIRS = "tests/fixtures/preference/pairs.jsonl"
FIELDS = ["--prompt-field", "prompt", "--chosen-field", "chosen", "--rejected-field", "rejected"]
BETA = 0.1


@pytest.fixture(autouse=True)
def at_root(monkeypatch, request):
    monkeypatch.chdir(request.config.rootpath)


@pytest.fixture(scope="module")
def references(tmp_path_factory, request) -> dict[str, str]:
    """Reference sources: "lora", an spmd checkpoint of the peft policy of make_preference.py
    (BASE under the peft_llama adapter: a LoRA run's one step at lr 1e-30, which leaves every
    value as it was); "peft", that model merged as a Hugging Face folder (spmd.convert
    --to-hf); "base", BASE as an spmd checkpoint (spmd.convert --to)."""
    from spmd import convert

    folder = tmp_path_factory.mktemp("references")
    root = request.config.rootpath
    done = train_in_process(
        "--init-from-hf", str(root / BASE), "--init-from-peft", str(root / PEFT),
        "--data", str(root / PAIRS), "--prompt-field", "prompt", "--response-field", "chosen",
        "--seq-len", "16", "--batch", "4", "--steps", "1", "--lr", "1e-30",
        "--eval-fraction", "0", "--precision", "fp32", "--run-dir", "none", "--mesh", "dp=1",
        "--checkpoint-dir", str(folder / "lora"), "--data-cache", str(folder / "cache"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lora, peft, base = (str(folder / name) for name in ("lora", "peft", "base"))
    assert convert.main(["--checkpoint", lora, "--to-hf", peft, "--mesh", "dp=1"]) == 0
    assert convert.main(["--from-hf", str(root / BASE), "--to", base, "--mesh", "dp=1"]) == 0
    return {"lora": lora, "peft": peft, "base": base}


def dpo_run(tmp_path, reference: str, *flags: str) -> list[dict]:
    """The config and train records of a full fine-tune's DPO on the fixture's 4 text pairs
    (one batch of 8 rows) from BASE, fsdp=2, with `reference`."""
    metrics = tmp_path / "m.jsonl"
    done = train_in_process(
        "--init-from-hf", BASE, "--objective", "dpo", "--dpo-reference", reference,
        "--data", PAIRS, *FIELDS, "--seq-len", "48", "--batch", "8", "--eval-fraction", "0",
        "--precision", "fp32", "--run-dir", "none", "--mesh", "fsdp=2", "--log-every", "1",
        "--metrics", str(metrics), "--data-cache", str(tmp_path / "cache"), *flags,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return [r for r in records(metrics) if r["kind"] in ("config", "train")]


def test_a_reference_equal_to_the_policy_gives_log_2_and_stays_frozen(tmp_path, references):
    # the reference from an spmd checkpoint of the policy's own weights
    config, first, second = dpo_run(tmp_path, references["base"], "--steps", "2", "--warmup", "0")
    assert abs(first["loss"] - math.log(2)) < 1e-6
    for name in ("chosen", "rejected", "margins"):
        assert first[f"rewards/{name}"] == 0.0, name
    # after one update the policy moved and the reference did not (were it trained too, or
    # the same arrays, the margin would stay 0): DPO's first step raises the margin
    assert second["rewards/margins"] > 1e-4, second
    # the step holds two copies of the params, the optimizer state the policy's moments only
    n = config["n_params"]
    state = config["state_bytes_per_device"]
    assert state["params"] == pytest.approx(2 * n * 4 / 2, rel=0.02)  # fp32, split over fsdp=2
    assert state["opt_state"] == pytest.approx(2 * n * 4 / 2, rel=0.02)  # AdamW: mu, nu


def test_a_reference_that_differs_gives_the_loss_of_both_models_logps(tmp_path, references):
    """Policy BASE, reference the peft model as a Hugging Face folder: make_preference.py's
    two models with their roles swapped, so the loss is computed here from transformers'
    log-probs. A LoRA checkpoint itself is refused, naming the export that merges it."""
    with np.load("tests/fixtures/preference/expected.npz") as npz:
        policy_c, policy_r = npz["reference_chosen"], npz["reference_rejected"]  # BASE's
        ref_c, ref_r = npz["policy_chosen"], npz["policy_rejected"]  # the peft model's
    margin = jnp.asarray((policy_c - policy_r) - (ref_c - ref_r))
    want = float(jnp.mean(-jax.nn.log_sigmoid(BETA * margin)))
    _, got = dpo_run(tmp_path, references["peft"], "--steps", "1")
    assert abs(got["loss"] - want) < 1e-5, (got["loss"], want)
    assert abs(got["rewards/chosen"] - BETA * np.mean(policy_c - ref_c)) < 1e-5
    assert abs(got["rewards/rejected"] - BETA * np.mean(policy_r - ref_r)) < 1e-5
    assert abs(got["loss"] - math.log(2)) > 0.1  # the two models differ
    done = train_in_process(
        "--init-from-hf", BASE, "--objective", "dpo", "--dpo-reference", references["lora"],
        "--data", PAIRS, *FIELDS, "--run-dir", "none", "--data-cache", str(tmp_path / "c"),
    )  # fmt: skip
    assert done.returncode == 2 and "holds a LoRA run's adapters" in done.stderr, done.stderr


def test_precomputed_reference_logps_train_as_the_copy_does_without_holding_it(
    tmp_path, references
):
    """--dpo-precompute-reference (spmd.reference_cache): the copy's log-probs computed once
    before training on a forward-only program of their own; the step holds the policy alone
    (one copy of the params) and its losses and eval loss are the in-step copy's."""
    flags = ("--steps", "2", "--warmup", "0", "--batch", "4", "--eval-fraction", "0.5")
    flags += ("--eval-every", "2", "--eval-batches", "1")
    runs = {}
    for name, extra in (("copy", ()), ("precomputed", ("--dpo-precompute-reference",))):
        logged = records_of(tmp_path / name, references["peft"], *flags, *extra)
        runs[name] = logged
    config = runs["precomputed"][0]
    assert config["state_bytes_per_device"]["params"] == pytest.approx(
        config["n_params"] * 4 / 2, rel=0.02
    )  # fp32 over fsdp=2: the policy alone, where the in-step copy's step holds two
    assert runs["copy"][0]["state_bytes_per_device"]["params"] == pytest.approx(
        2 * config["n_params"] * 4 / 2, rel=0.02
    )
    for kind in ("train", "eval"):
        got = [r["loss"] for r in runs["precomputed"] if r["kind"] == kind]
        want = [r["loss"] for r in runs["copy"] if r["kind"] == kind]
        assert len(got) == len(want) > 0 and np.allclose(got, want, atol=1e-6), (kind, got, want)
    assert abs(runs["precomputed"][1]["loss"] - math.log(2)) > 0.05  # policy and copy differ


def records_of(folder, reference: str, *flags: str) -> list[dict]:
    """The config, train and eval records of `dpo_run` in its own folder."""
    folder.mkdir()
    metrics = folder / "m.jsonl"
    done = train_in_process(
        "--init-from-hf", BASE, "--objective", "dpo", "--dpo-reference", reference,
        "--data", PAIRS, *FIELDS, "--seq-len", "48", "--precision", "fp32", "--run-dir", "none",
        "--mesh", "fsdp=2", "--log-every", "1", "--metrics", str(metrics),
        "--data-cache", str(folder / "cache"), *flags,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return [r for r in records(metrics) if r["kind"] in ("config", "train", "eval")]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ("--dpo-reference", "tests/fixtures/hf_llama_tied"),
            "--dpo-reference tests/fixtures/hf_llama_tied has a vocabulary of 64 tokens and "
            "the policy 128",
        ),
        (
            ("--dpo-reference", BASE, "--objective", "orpo"),
            f"--dpo-reference {BASE} is DPO's reference model, which --objective orpo",
        ),
        (("--dpo-reference", BASE, "--lora-rank", "4"), "a LoRA run's reference is its own"),
        (("--dpo-reference", "no/such/folder"), "is neither a Hugging Face folder"),
        ((), "or, for a full fine-tune, --dpo-reference PATH_OR_HUB_ID"),
    ],
)
def test_a_reference_that_cannot_serve_exits_2(tmp_path, flags, says):
    done = train_in_process(
        "--init-from-hf", BASE, "--objective", "dpo", "--data", PAIRS, *FIELDS,
        "--seq-len", "32", "--batch", "8", "--steps", "1", "--run-dir", "none", "--mesh", "dp=1",
        "--data-cache", str(tmp_path / "c"), *flags,
    )  # fmt: skip
    assert done.returncode == 2 and says in done.stderr, done.stderr[-1000:]
    assert len(done.stderr.strip().splitlines()) == 1


def test_accumulation_keeps_a_pairs_rows_in_one_micro_batch():
    """Both executors' micro-batches (spmd.engine.accumulate.micro_batches): every accum-th
    row, or under pairs every accum-th pair of rows (chosen 2i, rejected 2i + 1)."""
    from spmd.engine.accumulate import micro_batches
    from spmd.engine.options import StepOptions
    from spmd.sections import PAIRS as RESPONSE

    rows = jnp.arange(8)
    assert micro_batches(rows, 2).tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert micro_batches(rows, 2, 2).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert StepOptions(batch_fields=("inputs", "targets", RESPONSE)).row_group == 2
    assert StepOptions().row_group == 1


def test_the_planner_counts_the_reference_forward_and_the_copy(capsys):
    """spmd.estimate: DPO's model FLOPs are next-token training's plus one forward of every
    row (4/3 of them in a full fine-tune: 8 N against 6 N, as the run's own count), its
    executed FLOPs the same forward more, and a full fine-tune's frozen copy doubles the
    params and nothing else; LoRA-DPO's reference is the base (no bytes added). The plan
    prints the figure."""
    import dataclasses

    from spmd import plan
    from spmd.estimate import cost, memory, timing
    from spmd.parallel.mesh import parse_mesh
    from tests import trainer

    model = trainer.tiny_config()
    base = cost.Setup(
        shape=model.shape(), n_params=model.n_params(), mesh=parse_mesh("dp=2,fsdp=2"),
        zero=3, precision="bf16", optimizer="adamw", batch=16, seq_len=64,
    )  # fmt: skip
    dpo = dataclasses.replace(base, objective="dpo")
    assert timing.model_flops(dpo) == pytest.approx(timing.model_flops(base) * 4 / 3)
    forward = timing.reference_flops(dpo)
    assert forward == pytest.approx(timing.model_flops(base) / 3)
    assert timing.executed_flops(dpo) - timing.executed_flops(base) < forward
    assert timing.executed_flops(dpo) - timing.executed_flops(base) > 0.9 * forward
    plain, with_copy = memory.model_state_bytes(base), memory.model_state_bytes(dpo)
    assert with_copy["params"] == pytest.approx(2 * plain["params"])
    assert with_copy["optimizer"] == plain["optimizer"] and with_copy["grads"] == plain["grads"]
    lora = dataclasses.replace(dpo, lora_rank=4, lora_targets=("q", "v"))
    lora_next = dataclasses.replace(lora, objective="next_token")
    assert memory.model_state_bytes(lora)["params"] == memory.model_state_bytes(lora_next)["params"]
    assert timing.reference_flops(lora) == pytest.approx(forward)
    assert timing.reference_flops(dataclasses.replace(base, objective="orpo")) == 0.0
    args = ["--model", "tiny", "--mesh", "dp=2,fsdp=2", "--batch", "16", "--seq-len", "64"]
    assert plan.main([*args, "--objective", "dpo"]) == 0
    shown = capsys.readouterr().out
    assert "DPO: 8 pairs per step (16 rows); the reference forward" in shown
    assert "the reference is a frozen copy" in shown
    # --dpo-precompute-reference: the step is next-token training's, no forward, no copy
    pre = dataclasses.replace(dpo, reference_precomputed=True)
    assert timing.model_flops(pre) == timing.model_flops(base)
    assert timing.reference_flops(pre) == 0.0
    assert memory.model_state_bytes(pre) == memory.model_state_bytes(base)
    assert plan.main([*args, "--objective", "dpo", "--dpo-precompute-reference"]) == 0
    assert "the reference forward" not in capsys.readouterr().out
