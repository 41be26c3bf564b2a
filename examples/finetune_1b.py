"""The seed exercise, worked: a sharded fine-tune of a 1B-parameter model (Llama-3.2-1B's shape),
with the memory per device before and after sharding and the held-out loss before and after.

Four parts, each through the commands a user runs (in-process here, on 8 simulated CPU devices
unless real accelerators are present):

1. memory per device: 1 device against fsdp=8 under ZeRO-1, 2 and 3, bf16, from the planner's
   formula and from the compiled train step (`spmd.plan --measure`, which compiles the step and
   allocates nothing);
2. the seeds' question, "6 GPUs x 16 GB: a 1B model with Adam in mixed precision within 2
   hours?", answered with `spmd.plan --recommend` for a 16 GB GPU sustaining --tflops;
3. a short SFT run (prompt/response pairs, the loss on responses only) on fsdp=8 ZeRO-3 in bf16:
   from the real weights when `--hf` names a folder or a Hub id in the local cache, else from a
   random initialisation, with the held-out loss before the first step and after the last;
4. the same SFT with LoRA (`--lora-rank 16`: a frozen base in bf16, adapters on every
   projection with an fp32 master; docs/strategies/lora.md).

    python examples/finetune_1b.py                           # the 1B shape (slow on a CPU)
    python examples/finetune_1b.py --hf meta-llama/Llama-3.2-1B --steps 200
    python examples/finetune_1b.py --model tiny --seq-len 64 --sft-seq-len 32   # a minute on CPU

It prints FAILED and exits 1 when sharding does not shrink the state per device as ZeRO says,
the compiled state is off the formula by more than 1%, or fine-tuning does not lower the held-out
loss.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
import tempfile
from pathlib import Path

LAYOUTS = [("1 device", "dp=1", 0), ("ZeRO-1", "fsdp=8", 1), ("ZeRO-2", "fsdp=8", 2)]
LAYOUTS.append(("ZeRO-3", "fsdp=8", 3))
GB = 1e9


def json_of(main, argv: list[str]) -> dict:
    """Run a command's main(argv) in this process and read the JSON it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    if code:
        raise SystemExit(f"FAILED: {' '.join(argv)} exited with status {code}")
    text = out.getvalue()
    return json.loads(text[text.index("{") :])


def memory_table(model: str, batch: int, seq_len: int) -> list[str]:
    """Print planned and compiled bytes per device for each layout; return the failures."""
    from spmd import plan

    print(f"\n1. memory per device, {model} in bf16, batch {batch} x {seq_len} tokens (GB)")
    print(f"{'':<10}{'planned:':>9}{'':>29}{'compiled:':>12}")
    head = ("params", "master+opt", "activ.", "total", "params", "master+opt", "temp", "peak")
    print(f"{'layout':<10}" + "".join(f"{h:>11}" for h in head))
    rows, failures = {}, []
    for name, mesh, zero in LAYOUTS:
        argv = ["--model", model, "--mesh", mesh, "--zero", str(zero), "--precision", "bf16"]
        argv += ["--batch", str(batch), "--seq-len", str(seq_len), "--measure", "--json"]
        p = json_of(plan.main, argv)
        m = p["measured"]
        state = m["rows"]["master + optimizer state"]
        rows[name] = m["rows"]["params"]["compiled"] + state["compiled"]
        cells = (
            p["params_bytes_per_device"],
            p["optimizer_bytes_per_device"],
            p["activation_bytes_per_device"],
            p["total_bytes_per_device"],
            m["rows"]["params"]["compiled"],
            state["compiled"],
            m["compiled_memory"]["temp"],
            m["compiled_memory"]["peak_estimate"],
        )
        print(f"{name:<10}" + "".join(f"{c / GB:>11.3f}" for c in cells))
        for row in ("params", "master + optimizer state"):
            ratio = m["rows"][row]["ratio"]
            if abs(ratio - 1) > 0.01:
                failures.append(f"{name}: compiled {row} is {ratio:.3f}x the formula")
    print("planned total = params + gradients + master/optimizer + activations + runtime overhead")
    one, zero3 = rows["1 device"], rows["ZeRO-3"]
    print(f"params + master + optimizer per device: {one / GB:.2f} GB on 1 device, ", end="")
    print(f"{zero3 / GB:.2f} GB under ZeRO-3 on 8 ({one / zero3:.1f}x less)")
    if not rows["ZeRO-1"] < one or not zero3 < rows["ZeRO-2"] or one / zero3 < 7.5:
        failures.append("sharding did not shrink the state per device as ZeRO says")
    return failures


def seeds_question(model: str, tflops: float) -> None:
    """Print the planner's answer to "6 GPUs x 16 GB, within 2 hours?"."""
    from spmd import plan

    argv = ["--model", model, "--devices", "6", "--hbm", "16", "--tflops", str(tflops)]
    argv += ["--bandwidth", "150", "--precision", "fp16", "--seq-len", "2048"]
    argv += ["--tokens-per-step", "1048576", "--recommend", "--json"]
    print("\n2. 6 GPUs x 16 GB: python -m spmd.plan " + " ".join(argv[:-1]))
    p = json_of(plan.main, argv)
    rec = p["recommendation"]
    tokens_2h = p["tokens_per_s"] * 7200
    print(f"   fits: {p['fits']}, {p['total_bytes_per_device'] / GB:.1f} GB of 16 per device")
    print(f"   {rec['label']}: a step of {p['batch']['tokens']:,} tokens in ", end="")
    print(f"{p['step_time_s']:.1f} s, {p['tokens_per_s']:,.0f} tokens/s")
    print(f"   in 2 hours: {tokens_2h / 1e6:,.0f} M tokens ({7200 / p['step_time_s']:.0f} steps)")
    print(f"   run it: {rec['train_command']}")


def write_sft(folder: Path, n: int = 2000) -> tuple[Path, Path]:
    """(sft.jsonl, tokenizer.json): n addition problems and a tokenizer of their characters."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    rng = random.Random(0)
    with open(folder / "sft.jsonl", "w") as f:
        for _ in range(n):
            a, b = rng.randrange(1000), rng.randrange(1000)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n")
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "sft.jsonl", folder / "tokenizer.json"


def cached_hf(name: str) -> str:
    """The local folder of `name` (a folder, or a Hub id found in the local cache), or ""."""
    if not name or Path(name).is_dir():
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception as error:  # not cached (or not a valid id): random init instead
        print(f"   {name} is not in the local Hugging Face cache ({type(error).__name__})")
        return ""


def fine_tune(args: argparse.Namespace, folder: Path, lora_rank: int = 0) -> list[str]:
    """Run the SFT (with `lora_rank` > 0: LoRA adapters on a frozen base, at --lora-lr) and
    print the held-out loss before and after; return the failures."""
    from spmd import train

    folder = folder / f"lora{lora_rank}"
    folder.mkdir()
    data, char_tokenizer = write_sft(folder)
    hf = cached_hf(args.hf)
    source = ["--init-from-hf", hf] if hf else ["--model", args.model]
    tokenizer = hf or str(char_tokenizer)  # --tokenizer takes the model's folder too
    what = f"the weights of {args.hf}" if hf else f"a random {args.model} initialisation"
    lora = ["--lora-rank", str(lora_rank)] if lora_rank else []
    lr, label = (args.lora_lr, f"LoRA r={lora_rank} ") if lora_rank else (args.lr, "")
    part = f"4. {label}" if lora_rank else "3. "
    print(f"\n{part}SFT on fsdp=8 ZeRO-3 in bf16, from {what}")
    metrics = folder / "metrics.jsonl"
    argv = [
        *source,
        *("--data", str(data), "--prompt-field", "prompt", "--response-field", "response"),
        *("--tokenizer", tokenizer, "--data-cache", str(folder / "cache")),
        *("--mesh", "fsdp=8", "--zero", "3", "--precision", "bf16"),
        *("--seq-len", str(args.sft_seq_len), "--batch", str(args.batch)),
        *("--steps", str(args.steps), "--warmup", str(max(1, args.steps // 10))),
        *("--lr", str(lr), "--log-every", str(max(1, args.steps // 5)), *lora),
        *("--eval-at-start", "--eval-every", "0", "--eval-batches", "2"),
        *("--metrics", str(metrics), "--run-dir", str(folder / "run"), "--checkpoint-dir", "none"),
    ]
    print("   python -m spmd.train " + " ".join(argv))
    if code := train.main(argv):
        return [f"the trainer exited with status {code}"]
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "eval"]
    before, after = evals[0]["loss"], evals[-1]["loss"]
    print(
        f"{label}held-out loss: {before:.4f} before fine-tuning, {after:.4f} after "
        f"{args.steps} steps"
    )
    return [] if after < before else [f"{label}fine-tuning did not lower the held-out loss"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b", help="preset in configs/ for parts 1 and 2")
    parser.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (part 1)")
    parser.add_argument("--tflops", type=float, default=50.0, help="sustained TFLOP/s (part 2)")
    parser.add_argument("--hf", default="", help="HF folder or Hub id to fine-tune (part 3)")
    parser.add_argument("--steps", type=int, default=30, help="SFT optimizer steps")
    parser.add_argument("--sft-seq-len", type=int, default=128, help="SFT sequence length")
    parser.add_argument("--lr", type=float, default=3e-4, help="SFT peak learning rate")
    parser.add_argument("--lora-rank", type=int, default=16, help="part 4's LoRA rank (0: skip)")
    parser.add_argument("--lora-lr", type=float, default=3e-3, help="part 4's peak LR")
    args = parser.parse_args(argv)

    import spmd

    spmd.simulate_cpu_devices(8, announce=False)
    failures = memory_table(args.model, args.batch, args.seq_len)
    seeds_question(args.model, args.tflops)
    with tempfile.TemporaryDirectory() as tmp:
        failures += fine_tune(args, Path(tmp))
        if args.lora_rank:
            failures += fine_tune(args, Path(tmp), args.lora_rank)
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
