"""Generation with transformers on one GPU, the reference for `spmd.generate`'s tokens/s.

    python benchmarks/hf_generate.py make FOLDER          a random 1B bf16 Llama (configs/1b.toml)
    python benchmarks/hf_generate.py time FOLDER TEXT N BATCH

`time` runs greedy `generate` of N new tokens after TEXT's UTF-8 bytes as token ids (what
spmd.generate feeds a folder without a tokenizer), BATCH copies, twice, and prints one JSON
line of the second (warm) round. Run by benchmarks/gpu_check.py under an interpreter with
torch and transformers.
"""

import json
import sys
import time

import torch
from torch_gpu import ONE_B
from transformers import LlamaConfig, LlamaForCausalLM


def make(folder: str) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(**ONE_B, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def time_generate(folder: str, text: str, new: int, batch: int) -> None:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([list(text.encode())] * batch, device="cuda")
    for _ in range(2):  # the first round compiles and warms the kernels
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "tokens_per_s": batch * new / seconds}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        time_generate(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
