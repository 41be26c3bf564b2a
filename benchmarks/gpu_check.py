"""The GPU check: what a developer or reviewer with one GPU runs first (benchmarks/gpu_check.sh).

    python benchmarks/gpu_check.py [--out gpu_check.json] [--budget 470] [--only a,b]
    python benchmarks/gpu_check.py --smoke        # its CPU-only parts, tiny (the test suite's)

Runs each item as its own process under its own timeout, most important first, and skips
what no longer fits in --budget seconds: the 1b bench (bf16, batch 8 x 2048) at remat none
with the fused loss and without it (the GPU's default follows), at remat full, batch 16 and
2 x 8192; the training loop's median and p90 step against the bench's, with a profile and
its kernels by category; packed documents, a Gemma 2 shape and an MoE shape; --cp-mode
ulysses at cp=1 beside bench_long (and the ring against Ulysses over every GPU where there
are several); PyTorch eager and torch.compile when torch and transformers import;
--offload optimizer, --remat offload, fp8 when `--precision fp8` exists, --prefetch and
--bucket-mb where there are several devices; generation tokens/s against transformers'
generate. A failed item prints the tail of its output and the check goes on. It writes one
JSON (every item's figures, status and output tail) and prints one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
ONE_B = ["--config", "configs/1b.toml", "--precision", "bf16"]
BENCH = [sys.executable, "-m", "spmd.bench", *ONE_B, "--steps", "8", "--rounds", "2"]


@dataclasses.dataclass
class Item:
    name: str
    command: Callable[[Path], list[str]]  # (work folder) -> argv
    timeout: float  # seconds
    read: Callable[[Path, str], dict]  # (work folder, output) -> figures
    needs: str = ""  # "torch", "devices", "fp8": skipped where that is missing
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the environment


def bench_item(
    name: str, flags: list[str], timeout: float = 75, needs: str = "", env: dict | None = None
) -> Item:
    def command(work: Path) -> list[str]:
        return [*BENCH, *flags, "--json", str(work / f"{name}.json")]

    def read(work: Path, output: str) -> dict:
        result = json.loads((work / f"{name}.json").read_text())
        if "error" in result:
            raise RuntimeError(result["error"][-1])
        return result

    return Item(name, command, timeout, read, needs, env or {})


def train_command(work: Path) -> list[str]:
    """20 steps logged every step, steps 9-10 profiled: the loop's median / p90 and a trace."""
    return [
        *(sys.executable, "-m", "spmd.train", *ONE_B, "--remat", "none", "--steps", "20"),
        *("--log-every", "1", "--eval-fraction", "0", "--checkpoint-dir", "none"),
        *("--profile", "9:10", "--profile-dir", str(work / "trace")),
        *("--metrics", str(work / "train.jsonl")),
    ]


def read_train(work: Path, output: str) -> dict:
    sys.path.insert(0, str(BENCHMARKS))
    import kernel_table

    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    summary = next(r for r in rows if r["kind"] == "summary")
    figures = {k: summary[k] for k in ("median_step_time_s", "p90_step_time_s", "marked_steps")}
    traces = glob.glob(str(work / "trace" / "**" / "perfetto_trace.json.gz"), recursive=True)
    if traces:
        figures["kernels"] = kernel_table.kernel_table(kernel_table.read(traces[0]), 2)
        print(kernel_table.format_table(figures["kernels"]))
    return figures


def read_json_line(work: Path, output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def read_generate(work: Path, output: str) -> dict:
    rate = re.findall(r"then ([\d.]+) tokens/s", output)
    if not rate:
        raise RuntimeError("spmd.generate printed no 'then N tokens/s'")
    return {"tokens_per_s": float(rate[-1])}


# Two layers more than none of the Qwen3-30B-A3B shape (d 2048, 128 experts of 768, top-8, 32 q /
# 4 kv heads of 128, vocab 151,936): four layers, one 4k sequence a row, bf16 (issue 57 item 6)
QWEN3_MOE_4L = [
    *("--family", "qwen3_moe", "--embed-dim", "2048", "--n-experts", "128"),
    *("--expert-mlp-dim", "768", "--experts-per-token", "8", "--n-heads", "32"),
    *("--n-kv-heads", "4", "--head-dim", "128", "--vocab-size", "151936", "--n-layers", "4"),
    *("--precision", "bf16", "--batch", "4", "--seq-len", "4096", "--remat", "full"),
]
# Gemma 2 2B's shape: soft-capped scores and logits, every other layer a 4,096-position window
GEMMA2_2B = [
    *("--family", "gemma2", "--embed-dim", "2304", "--n-layers", "26", "--n-heads", "8"),
    *("--n-kv-heads", "4", "--head-dim", "256", "--mlp-dim", "9216", "--vocab-size", "256000"),
    *("--precision", "bf16", "--batch", "2", "--seq-len", "8192", "--remat", "full"),
]


def documents_corpus(work: Path) -> Path:
    """A JSONL record corpus of this repository's docs, one paragraph a record (so most windows
    hold several documents and the run's document mask is on), repeated to about 4 MB."""
    corpus = work / "documents.jsonl"
    if not corpus.exists():
        paragraphs = [
            p.strip() for f in sorted((ROOT / "docs").rglob("*.md"))
            for p in f.read_text().split("\n\n") if p.strip()
        ]  # fmt: skip
        lines = [json.dumps({"text": p}) for p in paragraphs]
        copies = max(1, 4_000_000 // max(1, sum(map(len, lines))))
        corpus.write_text("\n".join(lines * copies) + "\n")
    return corpus


def documents_bench(name: str, mask: str) -> Item:
    """The 1b bench on the documents corpus with --document-mask `mask` (on / off)."""
    item = bench_item(name, ["--remat", "none", "--document-mask", mask], 120)
    flags = item.command

    def command(work: Path) -> list[str]:
        data = ["--data", str(documents_corpus(work)), "--data-cache", str(work / "doc_tokens")]
        return [*flags(work), *data]

    return dataclasses.replace(item, command=command)


PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
TORCH = [os.environ.get("TORCH_PYTHON", sys.executable)]


def gpu_count() -> int:
    """GPUs `nvidia-smi -L` lists (1 when it cannot be run)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        return 1
    return max(listed.count("GPU "), 1)


def gpu_items() -> list[Item]:
    """The GPU check's items, most important first."""
    devices = [f"fsdp={gpu_count()}"]
    long = ["--remat", "none", "--batch", "2", "--seq-len", "8192"]  # bench_long's step
    return [
        bench_item("bench_none", ["--remat", "none"]),
        bench_item("bench_none_unfused", ["--remat", "none", "--loss-chunk", "0"]),
        Item("train_profile", train_command, 120, read_train),
        bench_item("bench_full", ["--remat", "full"]),
        # the layer scan's memcpys (docs/speed.md): no scan at all, and XLA letting cuBLAS write
        # into / read from the stacked residuals in place (dynamic-slice fusion)
        bench_item("bench_unrolled", ["--remat", "none", "--scan-layers", "false"], 100),
        bench_item("bench_slice_fusion", ["--remat", "none"],
                   env={"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true"}),
        bench_item("bench_long", long),
        bench_item("bench_batch16", ["--remat", "full", "--batch", "16"], 90),
        # issue 58 item 5: packed documents (the kernel the run records), Gemma 2's soft-cap and
        # per-layer windows; issue 57 item 6: fine-grained MoE (the grouped kernel recorded)
        documents_bench("bench_documents", "on"),
        documents_bench("bench_documents_off", "off"),
        Item("bench_gemma2", lambda w: [
            sys.executable, "-m", "spmd.bench", *GEMMA2_2B, "--steps", "6", "--rounds", "2",
            "--json", str(w / "bench_gemma2.json")], 150, bench_item("bench_gemma2", []).read),
        Item("bench_qwen3_moe", lambda w: [
            sys.executable, "-m", "spmd.bench", *QWEN3_MOE_4L, "--steps", "6", "--rounds", "2",
            "--json", str(w / "bench_qwen3_moe.json")], 150,
            bench_item("bench_qwen3_moe", []).read),
        # issue 58 item 5: --cp-mode ulysses on one device, a sanity check (cp=1 leaves the
        # length whole, so its step should time as bench_long's); with several GPUs, the
        # length split over all of them by the ring and by Ulysses
        bench_item("bench_long_ulysses", [*long, "--mesh", "cp=1", "--cp-mode", "ulysses"]),
        bench_item("bench_cp_ring", [*long, "--mesh", f"cp={gpu_count()}", "--cp-mode", "ring"],
                   needs="devices"),
        bench_item("bench_cp_ulysses", [*long, "--mesh", f"cp={gpu_count()}",
                                        "--cp-mode", "ulysses"], needs="devices"),
        Item("torch_eager", lambda w: [*TORCH, str(BENCHMARKS / "torch_gpu.py")], 90,
             read_json_line, "torch"),
        Item("torch_compile", lambda w: [*TORCH, str(BENCHMARKS / "torch_gpu.py"), "--compile"],
             150, read_json_line, "torch"),
        bench_item("bench_offload_optimizer", ["--remat", "none", "--offload", "optimizer"]),
        bench_item("bench_remat_offload", ["--remat", "offload"]),
        bench_item("bench_fp8", ["--remat", "none", "--precision", "fp8"], needs="fp8"),
        bench_item("bench_prefetch", ["--mesh", *devices, "--collectives", "explicit",
                                      "--remat", "full", "--prefetch", "1"], needs="devices"),
        bench_item("bench_bucket", ["--mesh", *devices, "--collectives", "explicit",
                                    "--bucket-mb", "25"], needs="devices"),
        Item("hf_make", lambda w: [*TORCH, str(BENCHMARKS / "hf_generate.py"), "make",
                                   str(w / "hf1b")], 60, lambda w, o: {}, "torch"),
        Item("generate_spmd", lambda w: [
            sys.executable, "-m", "spmd.generate", "--from-hf", str(w / "hf1b"), "--prompt",
            PROMPT, "--max-new-tokens", "256", "--ignore-eos", "--temperature", "0"],
            90, read_generate, "torch"),
        Item("generate_hf", lambda w: [*TORCH, str(BENCHMARKS / "hf_generate.py"), "time",
                                       str(w / "hf1b"), PROMPT, "256", "1"],
             90, read_json_line, "torch"),
    ]  # fmt: skip


FAIL = "import sys; print('a line before'); sys.exit('smoke: this item fails on purpose')"


def smoke_items() -> list[Item]:
    """The CPU-only parts, tiny: a bench that must work, an item that must fail with its tail."""
    tiny = ["--model", "tiny", "--n-layers", "1", "--batch", "4", "--seq-len", "16"]
    bench = [sys.executable, "-m", "spmd.bench", *tiny, "--steps", "2", "--rounds", "1"]

    def data(work: Path) -> list[str]:  # this file as the corpus: no tokenizing of the default
        return ["--data", __file__, "--data-cache", str(work / "tokens")]

    return [
        Item("bench_tiny", lambda w: [*bench, *data(w), "--json", str(w / "bench_tiny.json")],
             120, lambda w, o: json.loads((w / "bench_tiny.json").read_text())),
        Item("must_fail", lambda w: [sys.executable, "-c", FAIL], 60, lambda w, o: {}),
    ]  # fmt: skip


def missing(need: str) -> str:
    """Why an item's need is not met here ("" when it is)."""
    if need == "torch":
        probe = "import torch, transformers; assert torch.cuda.is_available()"
        ok = subprocess.run([*TORCH, "-c", probe], capture_output=True).returncode == 0
        return "" if ok else "torch / transformers / CUDA not importable"
    if need == "devices":
        return "" if gpu_count() > 1 else "needs more than one device (none apply on one)"
    if need == "fp8":
        helped = subprocess.run(
            [sys.executable, "-m", "spmd.bench", "--help"], capture_output=True, text=True
        )
        return "" if "fp8" in helped.stdout else "--precision fp8 does not exist yet"
    return ""


def run_item(item: Item, work: Path, timeout: float) -> dict[str, Any]:
    """{"status": ok | failed | timeout, "seconds", figures..., "tail" on failure}."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT), **item.env}
    if "XLA_FLAGS" in item.env:  # the item's flags after the caller's
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {item.env['XLA_FLAGS']}".strip()
    try:
        done = subprocess.run(
            item.command(work), cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        output, status = done.stdout + done.stderr, "ok" if done.returncode == 0 else "failed"
    except subprocess.TimeoutExpired as e:
        output, status = _text(e.stdout) + _text(e.stderr), "timeout"
    result: dict[str, Any] = {"status": status, "seconds": round(time.perf_counter() - started, 1)}
    if status == "ok":
        try:
            result.update(item.read(work, output))
        except Exception as e:  # the command ran but left no figures: a failure too
            result["status"], result["error"] = "failed", f"{type(e).__name__}: {e}"
    if result["status"] != "ok":
        result["tail"] = [line for line in output.splitlines() if line.strip()][-15:]
        print(f"--- {item.name} {result['status']}; the end of its output:")
        print("\n".join(f"    {line}" for line in result["tail"]), flush=True)
    return result


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def headline(name: str, r: dict[str, Any]) -> str:
    """The table's figure of one item."""
    if r.get("status") != "ok":
        return r.get("why", "") or (r.get("error") or (r.get("tail") or [""])[-1])[:70]
    if "median_s" in r and isinstance(r["median_s"], dict):
        m = r["median_s"]
        mfu = r.get("mfu", {}).get("spmd")
        kernels = {k: v for k, v in r.get("model_choices", {}).items() if k != "fp8"}
        return (
            f"spmd {m['spmd'] * 1e3:.1f} ms, bare {m['bare'] * 1e3:.1f} ms"
            + (f", MFU {mfu:.1%}" if mfu else "")
            + (f", {kernels}" if kernels else "")
        )
    if "median_step_time_s" in r:
        return (
            f"median {r['median_step_time_s'] * 1e3:.1f} ms, p90 {r['p90_step_time_s'] * 1e3:.1f}"
        )
    if "median_s" in r:
        return f"{r['median_s'] * 1e3:.1f} ms/step, {r['tflops']:.0f} TFLOP/s"
    if "tokens_per_s" in r:
        return f"{r['tokens_per_s']:.1f} tokens/s"
    return ""


def verdicts(results: dict[str, dict]) -> dict[str, Any]:
    """What the issue's oracles say, where their items ran."""
    out: dict[str, Any] = {}
    fused, whole = results.get("bench_none", {}), results.get("bench_none_unfused", {})
    if fused.get("status") == whole.get("status") == "ok":
        f, w = fused["median_s"]["spmd"], whole["median_s"]["spmd"]
        out["fused_loss_default_on_gpu"] = "on" if f <= w * 1.01 else "off (slower)"
        out["fused_over_unfused"] = round(f / w, 3)
    for variant in ("bench_unrolled", "bench_slice_fusion"):
        other = results.get(variant, {})
        if fused.get("status") == other.get("status") == "ok":
            ratio = other["median_s"]["spmd"] / fused["median_s"]["spmd"]
            out[f"{variant}_over_bench_none"] = round(ratio, 3)
    train = results.get("train_profile", {})
    if fused.get("status") == train.get("status") == "ok":
        bench = fused["median_s"]["spmd"]
        out["loop_median_over_bench"] = round(train["median_step_time_s"] / bench, 3)
        out["loop_p90_over_bench"] = round(train["p90_step_time_s"] / bench, 3)
        kernels = train.get("kernels", {})
        out["copy_ms_per_step"] = kernels.get("categories", {}).get("copy")
        memcpy = kernels.get("memcpy", {}).get("ms_per_step")
        out["memcpy_ms_per_step"] = memcpy  # the layer scan's copies; oracle: under 5 ms
        if memcpy is not None:
            out["memcpy_under_5ms"] = memcpy < 5.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON written")
    parser.add_argument("--budget", type=float, default=470, help="seconds for all items")
    parser.add_argument("--only", default="", help="comma-separated item names to run")
    parser.add_argument("--smoke", action="store_true", help="the CPU-only parts, tiny")
    args = parser.parse_args(argv)
    items = smoke_items() if args.smoke else gpu_items()
    if args.only:
        items = [i for i in items if i.name in args.only.split(",")]
    deadline = time.perf_counter() + args.budget
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        work = Path(folder)
        for item in items:
            left = deadline - time.perf_counter()
            why = missing(item.needs) or ("" if left > 20 else "out of --budget")
            if why:
                results[item.name] = {"status": "skipped", "why": why}
                continue
            print(f"[{args.budget - left:5.0f} s] {item.name}", flush=True)
            results[item.name] = run_item(item, work, min(item.timeout, left))
    report = {"items": results, "verdicts": verdicts(results)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n{'item':26}{'status':9}{'s':>6}  figures")
    for name, r in results.items():
        print(f"{name:26}{r['status']:9}{r.get('seconds', 0):6.0f}  {headline(name, r)}")
    for key, value in report["verdicts"].items():
        print(f"{key}: {value}")
    print(f"wrote {args.out}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
