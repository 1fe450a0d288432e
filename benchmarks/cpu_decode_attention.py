"""Milliseconds per call of kvflow's CPU decode attention on a batch of decoding requests.

    .venv/bin/python benchmarks/cpu_decode_attention.py [--requests 64] [--context 129,192]
        [--threads 1] [--passes 7] [--copies 8] [--baseline-tree DIR] [--no-sdpa]
        [--dtypes float32,bfloat16] [--huge-pages] [--block-order random|engine] [--pool]

One decode step of ``--requests`` requests (one query token each) with SmolLM2-135M's attention
shape (9 query heads, 3 KV heads of 64) over contexts spread evenly over ``--context`` (lo,hi)
tokens, in a paged cache of 16-token blocks in random order, or with ``--block-order engine``
in the order CPU-W1's engine lays them out (each request's 8 prompt blocks consecutive and
after the previous request's, its decode blocks interleaved with the other requests'; CPU-W1's
decode steps see contexts 129-192), per dtype (fp32, bf16): ``NativeCpuKernels.paged_attention`` (the decode
path), and torch SDPA on the same K/V gathered into a padded batch (masked), as a plain-torch
yardstick; with ``--baseline-tree`` also the C kernels of that source tree
(``benchmarks/tree_kernels.py``), alternating with this tree's in every pass, and the ratio of
the two; with ``--huge-pages`` also this tree's kernels on copies of the caches advised onto
transparent huge pages (``kvflow.platforms.cpu_memory``). Each call reads another of ``--copies`` batches (distinct caches, together larger than
the last-level cache), so K/V come from memory as in a model's decode step, where the other
layers' weights and caches evict them. Each figure is the best pass of process CPU time (little
disturbed by other processes; with ``--pool``, wall time: the kernels run on kvflow's
CPU pool of ``--threads`` - 1 workers plus the caller, as in the engine); GB/s counts the K/V bytes read once. Prints the load average and
CPU with the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tree_kernels import kernels_and_baseline

from kvflow.kernels.cpu_pool import CpuPool
from kvflow.platforms.cpu_memory import zeros_on_huge_pages
from kvflow.runtime.malloc_env import keep_freed_memory

H, HKV, D, BLOCK = 9, 3, 64, 16


def engine_table(per_req: list[int], prompt_blocks: int) -> torch.Tensor:
    """The block table CPU-W1's engine builds (checked on a decode step's block tables):
    request r's first ``prompt_blocks`` blocks consecutive and after request r - 1's (prefill
    takes them from the free queue in order), its later blocks one per decode step of all
    requests, so request r's i-th decode block is prompt_blocks * R + (i * R + r)."""
    reqs = len(per_req)
    table = torch.zeros(reqs, max(per_req), dtype=torch.int32)
    for r, nb in enumerate(per_req):
        for i in range(nb):
            table[r, i] = (r * prompt_blocks + i if i < prompt_blocks
                           else prompt_blocks * reqs + (i - prompt_blocks) * reqs + r)
    return table


def decode_batch(requests: int, lo: int, hi: int, dtype: torch.dtype, sdpa: bool = True,
                 order: str = "random") -> dict:
    """q [R, H, D], a paged cache with each request's context (blocks permuted: order
    "random"; or as the engine lays them out: "engine", :func:`engine_table` with 128-token
    prompts), and (sdpa) the padded K/V [R, HKV, max_ctx, D] + mask for SDPA."""
    gen = torch.Generator()
    lens = torch.linspace(lo, hi, requests).round().to(torch.int32)
    per_req = [-(-int(n) // BLOCK) for n in lens]
    if order == "engine":
        table = engine_table(per_req, 128 // BLOCK)
        nblk = int(table.max()) + 1
    else:
        nblk = sum(per_req)
        perm = torch.randperm(nblk, generator=gen).to(torch.int32)
        table = torch.zeros(requests, max(per_req), dtype=torch.int32)
        start = 0
        for r, nb in enumerate(per_req):
            table[r, :nb] = perm[start:start + nb]
            start += nb
    cache = torch.randn(2, nblk, BLOCK, HKV, D, generator=gen).to(dtype)
    q = torch.randn(requests, H, D, generator=gen).to(dtype)
    batch = {"q": q, "cache": cache, "table": table, "lens": lens,
             "qsl": torch.arange(requests + 1, dtype=torch.int32)}
    if not sdpa:
        return batch
    max_ctx = int(lens.max())
    kv = cache[:, table.long()].reshape(2, requests, -1, HKV, D)[:, :, :max_ctx]
    kv = kv.transpose(2, 3).repeat_interleave(H // HKV, 2)  # [2, R, H, ctx, D]
    mask = torch.arange(max_ctx)[None, :] < lens[:, None]
    return {**batch, "k": kv[0], "v": kv[1], "mask": mask[:, None, None, :]}


def variants(b: dict, kernels, baseline, sdpa: bool, huge: bool) -> dict:
    """name -> a call computing the step's decode attention."""
    args = (b["q"], b["cache"], b["qsl"], b["lens"], b["table"], D**-0.5)
    q = b["q"][:, :, None, :]
    calls = {"kvflow": lambda: kernels.paged_attention(*args, validate=False)}
    if huge:
        cache = zeros_on_huge_pages(tuple(b["cache"].shape), b["cache"].dtype).copy_(b["cache"])
        huge_args = (b["q"], cache, *args[2:])
        calls["kvflow-huge-pages"] = lambda: kernels.paged_attention(*huge_args, validate=False)
    if baseline is not None:
        calls["baseline"] = lambda: baseline.paged_attention(*args, validate=False)
    if sdpa:
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(q, b["k"], b["v"],
                                                               attn_mask=b["mask"])
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", default="129,192")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--baseline-tree", default=None,
                        help="also time this kvflow source tree's C kernels")
    parser.add_argument("--no-sdpa", action="store_true")
    parser.add_argument("--huge-pages", action="store_true")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--block-order", choices=("random", "engine"), default="random",
                        help="the cache blocks' order: random, or as CPU-W1's engine lays "
                             "them out (prompt blocks consecutive, decode blocks interleaved)")
    parser.add_argument("--pool", action="store_true",
                        help="run on kvflow's CPU pool (threads - 1 workers), timed by wall clock")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels, baseline = kernels_and_baseline(args.baseline_tree)
    clock = time.process_time
    if args.pool:
        clock = time.perf_counter
        keep_freed_memory()  # as the engine's CPU model runner does
        for k in [kernels] + ([baseline] if baseline is not None else []):
            k.pool = CpuPool(k, args.threads - 1)
    lo, hi = map(int, args.context.split(","))
    model = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], check=False,
                           capture_output=True, text=True).stdout.strip()
    print(f"{model}; kernels {kernels.isa}; {args.threads} thread(s); load {os.getloadavg()}")
    for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
        batches = [decode_batch(args.requests, lo, hi, dtype, not args.no_sdpa,
                                args.block_order)
                   for _ in range(args.copies)]
        kv_bytes = 2 * int(batches[0]["lens"].sum()) * HKV * D * dtype.itemsize
        calls = [variants(b, kernels, baseline, not args.no_sdpa, args.huge_pages)
                 for b in batches]
        if args.huge_pages:
            rollup = Path("/proc/self/smaps_rollup")
            huge = [line for line in rollup.read_text().splitlines()
                    if line.startswith("AnonHugePages")] if rollup.exists() else []
            print(f"  this process: {huge[0].split(':')[1].strip() if huge else 'n/a'} "
                  f"on huge pages")
        best = dict.fromkeys(calls[0], float("inf"))
        for _ in range(args.passes):
            for name in best:
                start = clock()
                for copy in calls:
                    copy[name]()
                best[name] = min(best[name], (clock() - start) / len(calls))
        figures = ", ".join(f"{n} {1e3 * s:.3f} ms ({kv_bytes / s / 1e9:.1f} GB/s)"
                            for n, s in best.items())
        print(f"{args.requests} requests x {lo}-{hi} keys, {str(dtype)[6:]}: {figures}")
        if baseline is not None:
            print(f"  kvflow / baseline time: {best['kvflow'] / best['baseline']:.3f}")
        if args.huge_pages:
            print(f"  huge pages / 4 KB pages time: "
                  f"{best['kvflow-huge-pages'] / best['kvflow']:.3f}")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
