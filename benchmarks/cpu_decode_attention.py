"""Milliseconds per call of kvflow's CPU decode attention on a batch of decoding requests.

    .venv/bin/python benchmarks/cpu_decode_attention.py [--requests 64] [--context 129,192]
        [--threads 1] [--passes 7]

One decode step of ``--requests`` requests (one query token each) with SmolLM2-135M's attention
shape (9 query heads, 3 KV heads of 64) over contexts spread evenly over ``--context`` (lo,hi)
tokens, in a paged cache of 16-token blocks in random order (as CPU-W1's decode steps see it:
contexts 129-192), per dtype (fp32, bf16): ``NativeCpuKernels.paged_attention`` (the decode
path), and torch SDPA on the same K/V gathered into a padded batch (masked), as a plain-torch
yardstick. Each call reads another of ``--copies`` batches (distinct caches, together larger than
the last-level cache), so K/V come from memory as in a model's decode step, where the other
layers' weights and caches evict them. Each figure is the best pass of process CPU time (little
disturbed by other processes); GB/s counts the K/V bytes read once. Prints the load average and
CPU with the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu_native import native_cpu_kernels

H, HKV, D, BLOCK = 9, 3, 64, 16


def decode_batch(requests: int, lo: int, hi: int, dtype: torch.dtype) -> dict:
    """q [R, H, D], a paged cache with each request's context (blocks permuted), and the
    padded K/V [R, HKV, max_ctx, D] + mask for SDPA."""
    gen = torch.Generator()
    lens = torch.linspace(lo, hi, requests).round().to(torch.int32)
    per_req = [-(-int(n) // BLOCK) for n in lens]
    nblk = sum(per_req)
    perm = torch.randperm(nblk, generator=gen).to(torch.int32)
    cache = torch.randn(2, nblk, BLOCK, HKV, D, generator=gen).to(dtype)
    table = torch.zeros(requests, max(per_req), dtype=torch.int32)
    start = 0
    for r, nb in enumerate(per_req):
        table[r, :nb] = perm[start:start + nb]
        start += nb
    q = torch.randn(requests, H, D, generator=gen).to(dtype)
    max_ctx = int(lens.max())
    kv = cache[:, table.long()].reshape(2, requests, -1, HKV, D)[:, :, :max_ctx]
    kv = kv.transpose(2, 3).repeat_interleave(H // HKV, 2)  # [2, R, H, ctx, D]
    mask = torch.arange(max_ctx)[None, :] < lens[:, None]
    return {"q": q, "cache": cache, "table": table, "lens": lens,
            "qsl": torch.arange(requests + 1, dtype=torch.int32),
            "k": kv[0], "v": kv[1], "mask": mask[:, None, None, :]}


def variants(b: dict, kernels) -> dict:
    """name -> a call computing the step's decode attention."""
    args = (b["q"], b["cache"], b["qsl"], b["lens"], b["table"], D**-0.5)
    q = b["q"][:, :, None, :]
    return {"kvflow": lambda: kernels.paged_attention(*args, validate=False),
            "sdpa": lambda: F.scaled_dot_product_attention(q, b["k"], b["v"],
                                                           attn_mask=b["mask"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", default="129,192")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--copies", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native_cpu_kernels()
    if kernels is None:
        raise SystemExit("native CPU kernels unavailable")
    lo, hi = map(int, args.context.split(","))
    model = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], check=False,
                           capture_output=True, text=True).stdout.strip()
    print(f"{model}; kernels {kernels.isa}; {args.threads} thread(s); load {os.getloadavg()}")
    for dtype in (torch.float32, torch.bfloat16):
        batches = [decode_batch(args.requests, lo, hi, dtype) for _ in range(args.copies)]
        kv_bytes = 2 * int(batches[0]["lens"].sum()) * HKV * D * dtype.itemsize
        calls = [variants(b, kernels) for b in batches]
        best = dict.fromkeys(calls[0], float("inf"))
        for _ in range(args.passes):
            for name in best:
                start = time.process_time()
                for copy in calls:
                    copy[name]()
                best[name] = min(best[name], (time.process_time() - start) / len(calls))
        figures = ", ".join(f"{n} {1e3 * s:.3f} ms ({kv_bytes / s / 1e9:.1f} GB/s)"
                            for n, s in best.items())
        print(f"{args.requests} requests x {lo}-{hi} keys, {str(dtype)[6:]}: {figures}")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
