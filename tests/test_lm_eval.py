"""spmd's answers to lm-evaluation-harness's requests against lm-eval's own Hugging Face
backend on the same model (tests/fixtures/lm_eval/, made once by make_lm_eval.py: a tiny model
trained by spmd and exported with --to-hf, lm-eval 0.4.13's per-request answers). Neither
lm-eval, torch nor transformers is needed here: spmd.run.harness imports none of them."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from spmd import eval as spmd_eval
from spmd import train
from spmd.io.tokens import _load_tokenizer
from spmd.run import harness, harness_text, weights

HERE = Path(__file__).parent / "fixtures" / "lm_eval"
MODEL = HERE / "model"
EXPECTED = json.loads((HERE / "expected.json").read_text())
MAX_LENGTH = 64  # the export's max_position_embeddings: lm-eval's max_length
NO_LM_EVAL = importlib.util.find_spec("lm_eval") is None


@pytest.fixture(scope="module")
def scorer() -> harness.Harness:
    layout = weights.setup_layout("dp=2,fsdp=2,tp=2", 0, 3)
    loaded = weights.from_hf(str(MODEL), layout)
    path = str(MODEL / "tokenizer.json")
    text = harness_text.text_of(_load_tokenizer(path), path)
    return harness.Harness(loaded.program, loaded.params, text, MAX_LENGTH, 8)


def test_loglikelihoods_and_choices_equal_lm_eval_hf(scorer):
    task = EXPECTED["spmd_mcq"]
    got = scorer.loglikelihood([tuple(a) for a in task["arguments"]])
    logp = np.array([g[0] for g in got])
    want = np.array([a[0] for a in task["answers"]])
    assert np.abs(logp - want).max() < 1e-4
    assert [g[1] for g in got] == [a[1] for a in task["answers"]]  # is_greedy
    assert any(a[1] for a in task["answers"]) and not all(a[1] for a in task["answers"])
    choices = len(
        json.loads((HERE / "tasks" / "questions.jsonl").read_text().splitlines()[0])["choices"]
    )
    picked = logp.reshape(-1, choices).argmax(axis=1)
    assert (picked == want.reshape(-1, choices).argmax(axis=1)).all()
    assert "" in [a[0] for a in task["arguments"]]  # an empty context: the BOS prefix


def test_rolling_loglikelihoods_equal_lm_eval_hf(scorer):
    task = EXPECTED["spmd_rolling"]
    texts = [a[0] for a in task["arguments"]]
    assert max(len(scorer.text.encode(t)) for t in texts) > MAX_LENGTH  # several windows
    got = np.array(scorer.loglikelihood_rolling(texts))
    assert np.abs(got - np.array(task["answers"])).max() < 1e-4


def test_generations_equal_lm_eval_hf(scorer):
    task = EXPECTED["spmd_complete"]
    got = scorer.generate_until([(a[0], a[1]) for a in task["arguments"]])
    assert got == task["answers"]
    assert any(task["answers"])


def test_pairs_split_as_lm_eval_does():
    path = str(MODEL / "tokenizer.json")
    text = harness_text.text_of(_load_tokenizer(path), path)
    context, continuation = harness_text.pair_ids(text, "the sky is ", "blue")
    assert context == text.encode("the sky is")  # the space moved onto the continuation
    assert context + continuation == text.encode("the sky is blue")
    assert harness_text.pair_ids(text, "", "blue")[0] == [text.prefix_id]
    windows = harness_text.rolling_windows(list(range(10)), -1, 4)
    assert [x for _, x in windows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [c for c, _ in windows] == [[-1], [3], [5, 6, 7]]  # the last: a full window of 4 inputs
    assert harness.bucket(3, 64) == 16 and harness.bucket(17, 64) == 32
    assert harness.bucket(40, 40) == 40


@pytest.mark.skipif(not NO_LM_EVAL, reason="lm-eval is installed")
def test_without_lm_eval_the_flags_exit_2(capsys, tmp_path):
    args = ["--from-hf", str(MODEL), "--tasks", "spmd_mcq"]
    assert spmd_eval.main(args) == 2
    assert 'pip install -e ".[eval]"' in capsys.readouterr().err
    args = ["--steps", "2", "--eval-harness-every", "1", "--eval-harness-tasks", "x"]
    assert train.main(["--model", "tiny", *args, "--run-dir", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--eval-harness-every 1 needs lm-evaluation-harness" in err[0]


def test_bad_input_exits_2(capsys, tmp_path):
    for args, says in [
        (["--checkpoint", str(tmp_path / "absent"), "--tasks", "x"], "absent"),
        (["--from-hf", str(MODEL), "--tasks", ""], "--tasks is empty"),
        (["--from-hf", str(MODEL), "--tasks", "x", "--batch-size", "0"], "--batch-size 0"),
        (["--from-hf", str(MODEL), "--tasks", "x", "--include-path", "nope/"], "nope/"),
    ]:
        assert spmd_eval.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
