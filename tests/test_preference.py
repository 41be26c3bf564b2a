"""The preference objectives (spmd.engine.preference, spmd.io.pairs): the first step's DPO, IPO
and ORPO numbers that `spmd.train` logs equal transformers' (tests/fixtures/make_preference.py:
the untied Llama fixture as the reference, it under the peft_llama adapter as the policy) on 1
device and dp=2,fsdp=2,tp=2; LoRA-DPO learns a preference rule; bad input exits 2. Runs from
the repository root with relative paths, as a user does. About 25 s of CPU (42 s of wall time)
in all."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.cli import records, train_in_process

BASE = "tests/fixtures/hf_llama_untied"
PEFT = "tests/fixtures/peft_llama"
PAIRS = "tests/fixtures/preference/pairs.jsonl"
THREE_D = "dp=2,fsdp=2,tp=2"
FIELDS = ["--prompt-field", "prompt", "--chosen-field", "chosen", "--rejected-field", "rejected"]


@pytest.fixture(autouse=True)
def at_root(monkeypatch, request):
    monkeypatch.chdir(request.config.rootpath)


PRECOMPUTE = "--dpo-precompute-reference"
CHAT_PAIRS = "tests/fixtures/preference/chat_pairs.jsonl"
# message lists: no prompt field, the shared leading messages are the prompt
CHATS = ["--data", CHAT_PAIRS, "--tokenizer", "tests/fixtures/chat_tokenizer"]
CHATS += ["--chosen-field", "chosen", "--rejected-field", "rejected"]


def first_step(tmp_path, *flags: str, chats: bool = False) -> dict:
    """The train record of step 1 (its figures are taken before the update) of a one-step run
    on the fixture's text pairs (or chat pairs): 4 pairs in one batch of 8 rows; and the
    run's config record under "config"."""
    metrics = tmp_path / "m.jsonl"
    data = CHATS if chats else ["--data", PAIRS, *FIELDS]
    done = train_in_process(
        "--init-from-hf", BASE, "--init-from-peft", PEFT, *data,
        "--seq-len", "48", "--batch", "8", "--steps", "1", "--eval-fraction", "0",
        "--precision", "fp32", "--run-dir", "none", "--metrics", str(metrics),
        "--data-cache", str(tmp_path / "cache"), *flags,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    logged = records(metrics)
    config = next(r for r in logged if r["kind"] == "config")
    train = next(r for r in logged if r["kind"] == "train")
    return {**train, "config": config, "stdout": done.stdout}


def expected(chats: bool = False) -> dict:
    """make_preference.py's figures of the text pairs (or the chat pairs)."""
    prefix = "chat_" if chats else ""
    with np.load("tests/fixtures/preference/expected.npz") as npz:
        return {k[len(prefix) :]: npz[k] for k in npz.files if k.startswith(prefix)}


@pytest.mark.parametrize(
    ("mesh", "flags", "loss", "chats"),
    [
        ("dp=1", (), "dpo_loss", False),
        (THREE_D, ("--dpo-label-smoothing", "0.2"), "dpo_loss_smoothed", False),
        (THREE_D, ("--collectives", "explicit"), "dpo_loss", False),
        (THREE_D, (), "dpo_loss", True),
        # context parallelism's chunks summed per sequence, a pair's rows in one micro-batch
        ("dp=2,cp=2", ("--accum", "2", "--collectives", "explicit"), "dpo_loss", False),
        # the reference's log-probs computed before training and read with the data
        ("dp=1", (PRECOMPUTE,), "dpo_loss", False),
        ("dp=2,cp=2", (PRECOMPUTE, "--accum", "2", "--collectives", "explicit"), "dpo_loss", False),
    ],
)
def test_the_first_dpo_step_logs_transformers_numbers(tmp_path, mesh, flags, loss, chats):
    want = expected(chats)
    got = first_step(tmp_path, "--objective", "dpo", "--mesh", mesh, *flags, chats=chats)
    assert abs(got["loss"] - want[loss]) < 1e-5
    for name in ("chosen", "rejected", "margins", "accuracies"):
        assert abs(got[f"rewards/{name}"] - want[f"rewards_{name}"]) < 1e-5, name
    assert abs(got["logps/chosen"] - want["policy_chosen"].mean()) < 1e-4  # nats, ~-42
    # policy and reference differ: the check is not one of a zero margin
    assert abs(want["rewards_margins"]) > 0.1
    if PRECOMPUTE in flags:  # the step ran no reference forward: ORPO's 6 N, not DPO's 8 N
        assert "(--dpo-precompute-reference)" in got["stdout"]
        orpo = first_step(tmp_path / "orpo", "--objective", "orpo", "--mesh", mesh, *flags[1:])
        assert got["config"]["flops_per_step"] == orpo["config"]["flops_per_step"]


def test_ipo_and_orpo_log_transformers_losses(tmp_path):
    want = expected()
    ipo = first_step(tmp_path / "ipo", "--objective", "dpo", "--dpo-loss", "ipo", "--mesh", THREE_D)
    assert abs(ipo["loss"] - want["ipo_loss"]) < 1e-5 * want["ipo_loss"]  # ~24: relative
    for mesh, chats in (("dp=1", True), (THREE_D, False)):
        mine = expected(chats)
        orpo = first_step(tmp_path / mesh, "--objective", "orpo", "--mesh", mesh, chats=chats)
        assert abs(orpo["loss"] - mine["orpo_loss"]) < 1e-5, mesh
        assert abs(orpo["nll_loss"] - mine["orpo_nll"]) < 1e-5, mesh
        assert abs(orpo["logps/chosen"] - mine["policy_chosen_mean"].mean()) < 1e-5, mesh
    # DPO's reference is the frozen base itself: its compiled step takes the same arguments,
    # to the byte, as ORPO's, which has no reference (a second copy would add its bytes)
    argument = [r["config"]["memory_per_device"]["argument"] for r in (ipo, orpo)]
    assert argument[0] == argument[1], argument
    # and its model FLOPs count the reference's forward: 8 N per token where ORPO's are 6 N
    assert ipo["config"]["flops_per_step"] == pytest.approx(
        orpo["config"]["flops_per_step"] * 4 / 3
    )


def test_the_dry_run_counts_the_reference_forward():
    args = (
        "--init-from-hf", BASE, "--lora-rank", "4", "--objective", "dpo", "--data", PAIRS,
        *FIELDS, "--seq-len", "48", "--batch", "8", "--mesh", "dp=1", "--run-dir", "none",
        "--dry-run",
    )  # fmt: skip
    done = train_in_process(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if "compiled: dot instructions" in x)
    assert "model: 8 N tokens + attention (+ reference)" in done.stdout
    # the compiled step's matmuls against the formula with the reference's forward: 0.94 on
    # this fixture, as a next-token LoRA step is 0.92 x its 6 N formula (measured); against
    # 6 N alone the DPO step would be 1.25
    ratio = float(line.split("(")[1].split(" x model")[0])
    assert 0.9 <= ratio <= 1.0, line
    # with the reference's log-probs precomputed the step is a next-token LoRA step's size
    # against 6 N (were the reference forward still in it: 1.25 x that)
    done = train_in_process(*args, PRECOMPUTE)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if "compiled: dot instructions" in x)
    assert "(+ reference)" not in done.stdout and "DPO: " not in done.stdout
    ratio = float(line.split("(")[1].split(" x model")[0])
    assert 0.9 <= ratio <= 1.0, line


def rule_pairs(path, n: int) -> None:
    """n pairs of distinct prompts, 3 letters each (no palindrome): the chosen response repeats
    them, the rejected one reverses them."""
    words = [a + b + c for a in LETTERS for b in LETTERS for c in LETTERS if a != c]
    with path.open("w") as f:
        for word in random.Random(0).sample(words, n):
            record = {"prompt": f"{word}:", "chosen": f" {word}", "rejected": f" {word[::-1]}"}
            f.write(json.dumps(record) + "\n")


LETTERS = "abcdefghijkl"


def test_lora_dpo_learns_the_preferred_rule(tmp_path):
    # 80 steps of 16 pairs out of 1300: each step's figures (taken before its update) are of
    # pairs the adapters have not trained on, so the accuracy is a held-out one
    data, metrics = tmp_path / "rule.jsonl", tmp_path / "m.jsonl"
    rule_pairs(data, 1300)
    done = train_in_process(
        "--init-from-hf", BASE, "--lora-rank", "8", "--objective", "dpo", "--dpo-beta", "0.5",
        "--data", str(data), *FIELDS, "--seq-len", "12", "--batch", "32", "--steps", "80",
        "--lr", "1e-2", "--warmup", "5", "--eval-fraction", "0", "--log-every", "1",
        "--mesh", "dp=1", "--run-dir", "none", "--metrics", str(metrics),
        "--data-cache", str(tmp_path / "c"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [r for r in records(metrics) if r["kind"] == "train"]
    accuracy = [r["rewards/accuracies"] for r in steps]
    # step 1: the adapters' B are zeros, the policy is its reference: no margin, no accuracy
    # (a tie is not a win, as TRL counts); then chance, then the rule
    assert steps[0]["rewards/margins"] == 0.0 and accuracy[0] == 0.0
    assert np.mean(accuracy[1:6]) <= 0.75, accuracy[:6]
    assert np.mean(accuracy[-20:]) >= 0.9, accuracy[-20:]
    assert steps[-1]["rewards/margins"] > 1.0
    from spmd import report

    panels = [field for _, field, _, _ in report.panels_of([("r", report.load_segments(metrics))])]
    assert panels[-2:] == ["rewards/margins", "rewards/accuracies"]  # the report draws them


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ("--data", "tests/fixtures/preference/pairs.jsonl", "--prompt-field", "prompt",
             "--response-field", "chosen", "--lora-rank", "4"),
            "--objective dpo trains on preference pairs, and the data has none",
        ),
        ((*FIELDS, "--data", PAIRS, "--lora-rank", "4", "--dpo-beta", "0"), "--dpo-beta 0.0 must"),
        ((*FIELDS, "--data", PAIRS), "needs a reference model: LoRA's frozen base"),
        ((*FIELDS, "--data", PAIRS, "--lora-rank", "4", "--accum", "4"), "x --accum 4"),
        ((*FIELDS, "--data", f"a={PAIRS}:1,b={PAIRS}:1", "--lora-rank", "4"), "not a mixture"),
        ((*FIELDS, "--data", PAIRS, "--lora-rank", "4", "--mesh", "dp=4"), "multiple of 8"),
        ((*FIELDS, "--data", PAIRS, "--lora-rank", "4", "--objective", "orpo", PRECOMPUTE),
         "--dpo-precompute-reference computes DPO's reference log-probs, which --objective orpo"),
    ],
)  # fmt: skip
def test_bad_preference_input_exits_2(tmp_path, flags, says):
    flags = flags if "--mesh" in flags else (*flags, "--mesh", "dp=1")
    done = train_in_process(
        "--init-from-hf", BASE, "--objective", "dpo", "--seq-len", "32", "--batch", "12",
        "--steps", "1", "--run-dir", "none", "--data-cache", str(tmp_path / "c"), *flags,
    )  # fmt: skip
    assert done.returncode == 2 and says in done.stderr, done.stderr[-1000:]
    assert len(done.stderr.strip().splitlines()) == 1


def test_pair_rows_keep_each_sequence_alone_and_pairs_together(tmp_path, capsys):
    from spmd import data

    argv = ["--data", PAIRS, *FIELDS, "--data-cache", str(tmp_path / "c"), "--seq-len", "20"]
    assert data.main(["preview", *argv, "--windows", "2", "--eval-fraction", "0"]) == 0
    shown = capsys.readouterr().out
    # the first pair training reads, chosen then rejected, each from its own start, padded
    chosen, rejected = shown.split("=== window 2 (")[0], shown.split("=== window 2 (")[1]
    pair = chosen.split("(pair ")[1].split(" ")[0]
    assert f"pair {pair} chosen" in chosen and rejected.startswith(f"pair {pair} rejected")
    record = json.loads(Path(PAIRS).read_text().splitlines()[int(pair)])
    assert f"¶«{record['prompt']}»{record['chosen']}" in chosen
    assert f"¶«{record['prompt']}»{record['rejected']}" in rejected
    assert data.main(["stats", *argv]) == 0
    # two of the eight sequences are longer than a row of 21 tokens (27 and 25)
    stats = capsys.readouterr().out
    assert "preference pairs: 4, longest sequence 27 tokens" in stats
    assert "longer than a row (21 tokens), so cut at its end: 2" in stats


def test_a_chat_pair_without_a_shared_prompt_exits_2_naming_its_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    good = Path(CHAT_PAIRS).read_text().splitlines()[0]
    turn = {"role": "assistant", "content": "no"}
    data.write_text(f"{good}\n" + json.dumps({"chosen": [turn], "rejected": [turn]}) + "\n")
    flags = [*CHATS[2:], "--data", str(data), "--data-cache", str(tmp_path / "c")]
    done = train_in_process("--init-from-hf", BASE, "--objective", "dpo", "--lora-rank", "4",
                            "--run-dir", "none", "--steps", "1", *flags)  # fmt: skip
    assert done.returncode == 2, done.stderr[-1000:]
    assert f"{data} line 2: a conversation has no assistant message after" in done.stderr


def test_a_pair_row_is_its_sequence_from_its_start_padded_and_masked_past_its_end():
    from spmd.errors import UsageError
    from spmd.io.pairs import PairWindows

    tokens = np.arange(10, dtype=np.uint8)  # documents [0 1 2] [3 4 5] [6 7] [8 9]
    mask = np.array([0, 1, 1, 0, 1, 1, 0, 1, 0, 1], np.uint8)  # 1 on each response
    rows = PairWindows(tokens, np.array([3, 6, 8, 10]), mask, 4, 0.0).batch_rows(np.arange(4))
    assert rows["inputs"].tolist() == [[0, 1, 2, 0], [3, 4, 5, 0], [6, 7, 0, 0], [8, 9, 0, 0]]
    assert rows["targets"].tolist() == [[1, 2, 0, 0], [4, 5, 0, 0], [7, 0, 0, 0], [9, 0, 0, 0]]
    assert rows["response"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]
    with pytest.raises(UsageError, match="3 sequences, not whole pairs"):
        PairWindows(tokens, np.array([3, 6, 10]), mask, 4, 0.0)


def test_lora_dpo_on_an_moe_under_expert_parallelism_equals_one_device(tmp_path):
    """LoRA-DPO on the moe-tiny preset (seed-made base, so policy = reference at step 1):
    step 1's gradient norm and step 2's loss and margin (after one update the two differ) on
    fsdp=2,ep=2,tp=2 under the explicit executor equal one device's."""
    runs = []
    for mesh, devices in (("dp=1", "1"), ("fsdp=2,ep=2,tp=2", "8")):
        metrics = tmp_path / f"{devices}.jsonl"
        done = train_in_process(
            "--model", "moe-tiny", "--lora-rank", "4", "--objective", "dpo", "--data", PAIRS,
            *FIELDS, "--seq-len", "48", "--batch", "8", "--steps", "2", "--eval-fraction", "0",
            "--precision", "fp32", "--warmup", "0", "--lr-schedule", "constant", "--lr", "1e-2",
            "--log-every", "1", "--run-dir", "none", "--mesh", mesh, "--devices", devices,
            "--collectives", "explicit", "--metrics", str(metrics),
            "--data-cache", str(tmp_path / "cache"),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append([r for r in records(metrics) if r["kind"] == "train"])
    one, sharded = runs
    assert abs(one[0]["grad_norm"] - sharded[0]["grad_norm"]) < 1e-6 * one[0]["grad_norm"]
    assert abs(one[1]["loss"] - sharded[1]["loss"]) < 1e-6
    assert abs(one[1]["rewards/margins"] - sharded[1]["rewards/margins"]) < 1e-6
    assert one[1]["rewards/margins"] > 1e-3  # the update moved the policy off its reference
