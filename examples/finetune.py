"""Supervised fine-tuning of a Hugging Face Llama on prompt/response pairs, the loss on the
responses only.

Writes a small JSONL file of addition problems ({"prompt": "12+7=", "response": "19"}) and a
character-level tokenizer.json, then runs the trainer as a user would:

    python -m spmd.train --init-from-hf FOLDER --data sft.jsonl --prompt-field prompt \\
        --response-field response --tokenizer tokenizer.json ...

The documents are packed into windows with attention kept within each (--document-mask auto
turns it on for JSONL data), and only response tokens (and each document's end token) count in
the loss. The example checks that the token cache's loss mask covers exactly those tokens and
that the loss falls.

    python examples/finetune.py [--hf-folder tests/fixtures/hf_llama_tied] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_data(folder: Path, n: int = 400) -> tuple[Path, Path, list[tuple[str, str]]]:
    """(sft.jsonl, tokenizer.json, the pairs): n addition problems, a tokenizer of characters."""
    import random

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    rng = random.Random(0)
    pairs = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        pairs.append((f"{a}+{b}=", str(a + b)))
    data = folder / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return data, path, pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-folder", default=str(ROOT / "tests/fixtures/hf_llama_tied"))
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)

    from spmd import train

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data, tokenizer, pairs = write_data(folder)
        metrics = folder / "metrics.jsonl"
        code = train.main(
            [
                *("--init-from-hf", args.hf_folder, "--data", str(data)),
                *("--prompt-field", "prompt", "--response-field", "response"),
                *("--tokenizer", str(tokenizer), "--data-cache", str(folder / "cache")),
                *("--seq-len", "32", "--batch", "8", "--steps", str(args.steps)),
                *("--lr", "1e-2", "--warmup", "5", "--log-every", "1", "--eval-every", "0"),
                *("--mesh", "dp=2", "--devices", "2", "--metrics", str(metrics)),
                *("--run-dir", str(folder / "run")),  # the run's folder goes with the temp data
            ]
        )
        if code:
            print(f"FAILED: the trainer exited with status {code}")
            return 1
        import numpy as np

        (mask_file,) = (folder / "cache").glob("tokens-*.mask")
        counted = int(np.fromfile(mask_file, np.uint8).sum())
        expected = sum(len(r) + 1 for _, r in pairs)  # response characters + end token
        total = sum(len(p) + len(r) + 1 for p, r in pairs)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        steps, losses = zip(
            *[(r["step"], r["loss"]) for r in records if r["kind"] == "train"], strict=True
        )
    if counted != expected:
        print(f"FAILED: the loss mask counts {counted} tokens, the responses hold {expected}")
        return 1
    print(f"the loss counts only the response tokens: {counted} of {total} tokens")
    if not losses[-1] < 0.7 * losses[0]:
        print(f"FAILED: the loss went from {losses[0]:.3f} to {losses[-1]:.3f}")
        return 1
    print(
        f"fine-tuned from the Hugging Face checkpoint: loss {losses[0]:.3f} at step "
        f"{steps[0]} -> {losses[-1]:.3f} at step {steps[-1]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
