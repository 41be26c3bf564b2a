"""spmd's train step against PyTorch eager on the same Llama, side by side on one machine.

    python benchmarks/against_torch.py [--torch-python PY] [--threads N] [spmd.bench flags]

Three programs take turns in every round, so machine noise hits them alike:
  spmd:  the framework's compiled step fed by its data pipeline (as `spmd.bench` times it);
  bare:  a hand-written `jax.jit` step of the same math (spmd's overhead reference);
  torch: Hugging Face transformers' LlamaForCausalLM of the same shape, torch.optim.AdamW with
         the same betas, eps and weight decay, gradient clipping at the same norm, in eager
         mode on a fixed batch (benchmarks/torch_worker.py, run as a separate process).
torch and transformers are needed only here, and may live in another interpreter
(`--torch-python /path/to/venv/bin/python`); spmd and its tests never import them.

The default shape is the one the CPU comparison in docs/speed.md uses: d256, 4 layers, 8 heads
/ 4 kv heads of 32, MLP 688, vocabulary 256, sequence 256, batch 8, fp32, one device; spmd.bench
flags given after it override it (a mesh, --precision, --steps, --rounds ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPE = [
    *("--vocab-size", "256", "--embed-dim", "256", "--mlp-dim", "688", "--n-layers", "4"),
    *("--n-heads", "8", "--n-kv-heads", "4", "--head-dim", "32", "--tie-embeddings", "false"),
    *("--seq-len", "256", "--batch", "8", "--mesh", "dp=1", "--devices", "1"),
    *("--steps", "30", "--rounds", "3", "--remat", "none"),
]
WORKER = Path(__file__).resolve().parent / "torch_worker.py"


class TorchWorker:
    """benchmarks/torch_worker.py in its own process: `steps(n)` runs n steps there."""

    def __init__(self, python: str, spec: dict) -> None:
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = self.ask(json.dumps(spec))
        self.version, self.setup_s = ready["torch"], time.perf_counter() - started
        self.losses: list[float] = []

    def ask(self, line: str) -> dict:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise SystemExit(f"FAILED: {WORKER.name} exited; its error is above")
        return json.loads(answer)

    def steps(self, n: int) -> None:
        self.losses.append(self.ask(str(n))["loss"])

    def part(self, name: str) -> Any:
        """Run n calls of one part of the step alone there (benchmarks/step_parts.PARTS)."""
        return lambda n: self.ask(f"{name} {n}")

    def profile(self, n: int) -> list:
        return self.ask(f"profile {n}")["ops"]

    def close(self) -> None:
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait(timeout=60)


def torch_spec(cfg, threads: int) -> dict:
    """The worker's first line: the HF LlamaConfig and optimizer of spmd's resolved config."""
    m, opt = cfg.model, cfg.optimizer
    return {
        "config": {
            "vocab_size": m.vocab_size,
            "hidden_size": m.embed_dim,
            "intermediate_size": m.mlp_dim,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.head_dim,
            "rope_theta": m.rope_theta,
            "rms_norm_eps": m.norm_eps,
            "tie_word_embeddings": m.tie_embeddings,
            "max_position_embeddings": cfg.run.seq_len,
        },
        "batch": cfg.run.batch,
        "seq_len": cfg.run.seq_len,
        "threads": threads,
        "lr": opt.lr,
        "betas": [opt.beta1, opt.beta2],
        "eps": 1e-8,
        "weight_decay": opt.weight_decay,
        "grad_clip": opt.grad_clip,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-python", default=sys.executable, help="interpreter with torch")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--profile", type=int, default=0, help="also profile N steps of each")
    parser.add_argument(
        "--parts", action="store_true", help="also time forward, forward+backward and update"
    )
    args, rest = parser.parse_known_args(argv)
    from spmd.parallel import huge_pages

    # restarts this script once, as `python -m spmd.bench` restarts itself on a CPU under
    # --xla-preset throughput (huge pages for XLA's per-step buffers), before JAX is imported;
    # the torch worker, started after, inherits the same allocator setting
    huge_pages.restart_early(rest)
    from spmd import bench
    from spmd.log import say

    cfg, rounds, steps, compile_s, program, compiled = bench.prepare(
        SHAPE + rest, "against_torch.py", may_restart=True
    )
    if cfg.precision.precision != "fp32":
        raise SystemExit("FAILED: the torch reference trains in fp32; run with --precision fp32")
    worker = TorchWorker(args.torch_python, torch_spec(cfg, args.threads))
    steps["torch"], compile_s["torch"] = worker.steps, worker.setup_s
    per_round = max(cfg.run.steps // rounds, 1)
    times = bench.time_alternating(steps, rounds, per_round)
    bench.report(cfg, program, times, compile_s, f"{rounds} rounds x {per_round} steps")
    say(f"torch {worker.version}, {args.threads} threads, eager; each round's median:")
    for name, values in times.items():
        say(f"  {name:6}" + " ".join(f"{v * 1e3:8.1f}" for v in values) + " ms")
    medians = {name: statistics.median(t) for name, t in times.items()}
    say(f"torch / spmd step time: {medians['torch'] / medians['spmd']:.3f} (above 1: spmd faster)")
    if args.parts:
        time_parts(cfg, program, worker, rounds, per_round)
    if args.profile:
        from xla_ops import op_table

        say(f"spmd: XLA op time per step (ms, events per step), {args.profile} steps traced:")
        for label, ms, per_step in op_table(steps["spmd"], args.profile, compiled)[:25]:
            say(f"  {ms:9.2f} ms {per_step:6.0f}x  {label}")
        say(f"torch: self CPU time per step (ms), {args.profile} steps profiled:")
        for name, ms in worker.profile(args.profile)[:25]:
            say(f"  {ms:9.2f} ms  {name}")
    worker.close()
    return 0


def time_parts(cfg: Any, program: Any, worker: TorchWorker, rounds: int, per_round: int) -> None:
    """Each part of the step alone on both sides, all taking turns in every round; medians."""
    from step_parts import PARTS, spmd_parts

    from spmd import bench
    from spmd.log import say

    runs = {f"spmd {name}": run for name, run in spmd_parts(cfg, program).items()}
    runs |= {f"torch {name}": worker.part(name) for name in PARTS}
    medians = {
        name: statistics.median(t) * 1e3
        for name, t in bench.time_alternating(runs, rounds, per_round).items()
    }
    say(f"each part alone, median of {rounds} rounds x {per_round} calls (ms):")
    say(f"  {'part':18} {'spmd':>9} {'torch':>9}")
    for name in PARTS:
        say(f"  {name:18} {medians['spmd ' + name]:9.1f} {medians['torch ' + name]:9.1f}")


if __name__ == "__main__":
    sys.exit(main())
