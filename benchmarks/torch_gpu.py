"""The PyTorch baseline of a Llama train step on one GPU, what a user would pick instead of spmd:
transformers' LlamaForCausalLM (sdpa attention), bf16 autocast over fp32 master weights,
fused AdamW (betas 0.9 / 0.95, matrix-only weight decay 0.1), gradient clipping at 1.0;
optionally under torch.compile or with gradient checkpointing. Prints one JSON line: median
step seconds, tokens/s, model TFLOP/s (6 N + causal attention per token).

    python benchmarks/torch_gpu.py --batch 8 --seq 2048 [--compile] [--ckpt] [--steps 8]

Run by benchmarks/gpu_check.py under an interpreter with torch and transformers; nothing of
spmd imports it.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ONE_B = dict(  # configs/1b.toml
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--ckpt", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(**ONE_B, max_position_embeddings=max(args.seq, 2048))
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).cuda().train()
    if args.ckpt:
        model.gradient_checkpointing_enable()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, cfg.vocab_size), targets.reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    run = torch.compile(step) if args.compile else step
    for _ in range(args.warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    n_params = sum(p.numel() for p in model.parameters())
    attention = 6 * cfg.num_hidden_layers * args.seq * cfg.num_attention_heads * cfg.head_dim
    tokens_per_step = args.batch * args.seq
    flops = (6 * n_params + attention) * tokens_per_step
    print(
        json.dumps(
            {
                "median_s": median,
                "tokens_per_s": tokens_per_step / median,
                "tflops": flops / median / 1e12,
                "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(),
            }
        )
    )


if __name__ == "__main__":
    main()
