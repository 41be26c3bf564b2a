"""The PyTorch eager side of benchmarks/against_torch.py: a Hugging Face transformers Llama of
the same shape, trained with torch.optim.AdamW on a fixed random batch.

Needs torch and transformers, and nothing of spmd, so it can run under another interpreter
(`--torch-python`). Talks over stdin / stdout, one JSON object a line:
  first line in:  {"config": {LlamaConfig fields}, "batch": B, "seq_len": T, "threads": N,
                   "lr": ..., "betas": [b1, b2], "weight_decay": ..., "eps": ...,
                   "grad_clip": global norm or 0}
  then "N" in -> {"seconds_per_step": s, "loss": l} out, after N steps (one sync at the end)
  "profile N" in -> {"ops": [[name, self cpu ms per step], ...]} out, from torch.profiler
  "forward N", "forward+backward N" or "update N" in -> {"seconds_per_step": s} out, after N
      calls of that part of the step alone (the loss without autograd; the loss and its
      gradients; clipping and AdamW's step of a copy of the params, on constant gradients)
  "quit" in -> exit.
"""

from __future__ import annotations

import copy
import json
import sys
import time


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = json.loads(sys.stdin.readline())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**spec["config"]))
    model.train()

    def adamw(of: torch.nn.Module) -> torch.optim.Optimizer:
        # weight decay on matrices only, as spmd's AdamW does
        matrices = [p for p in of.parameters() if p.ndim >= 2]
        vectors = [p for p in of.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}],
            lr=spec["lr"],
            betas=tuple(spec["betas"]),
            eps=spec["eps"],
            weight_decay=spec["weight_decay"],
        )

    optimizer = adamw(model)
    vocab = spec["config"]["vocab_size"]
    tokens = torch.randint(0, vocab, (spec["batch"], spec["seq_len"] + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_of_model() -> torch.Tensor:
        logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    def step() -> torch.Tensor:
        loss = loss_of_model()
        loss.backward()
        if spec["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    # The update part steps a copy, so that the other parts keep the initial params, with the
    # gradients spmd's side gets (step_parts.update_gradient: the standard library only)
    from step_parts import update_gradient

    twin = copy.deepcopy(model)
    twin_optimizer = adamw(twin)
    value = update_gradient(sum(p.numel() for p in twin.parameters()), spec["grad_clip"])
    for p in twin.parameters():
        p.grad = torch.full_like(p, value)

    def forward() -> None:
        with torch.no_grad():
            loss_of_model()

    def forward_backward() -> None:
        loss_of_model().backward()
        model.zero_grad(set_to_none=True)

    def update() -> None:
        if spec["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(twin.parameters(), spec["grad_clip"])
        twin_optimizer.step()

    parts = {"forward": forward, "forward+backward": forward_backward, "update": update}
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            return 0
        if command[0] == "profile":
            n = int(command[1])
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                for _ in range(n):
                    step()
            ops = [
                [e.key, e.self_cpu_time_total / 1e3 / n]
                for e in p.key_averages()
                if e.self_cpu_time_total > 0
            ]
            ops.sort(key=lambda row: -row[1])
            print(json.dumps({"ops": ops}), flush=True)
            continue
        if command[0] in parts:  # eager on a CPU: each call is done when it returns
            part, n = parts[command[0]], int(command[1])
            started = time.perf_counter()
            for _ in range(n):
                part()
            seconds = (time.perf_counter() - started) / n
            print(json.dumps({"seconds_per_step": seconds}), flush=True)
            continue
        n = int(command[0])
        started = time.perf_counter()
        for _ in range(n):
            loss = step()
        value = float(loss.detach())  # the sync: every step's work is done
        seconds = (time.perf_counter() - started) / n
        print(json.dumps({"seconds_per_step": seconds, "loss": value}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
