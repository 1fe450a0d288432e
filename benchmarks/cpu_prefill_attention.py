"""GFLOP/s of kvflow's CPU prefill attention paths vs torch SDPA on one long prompt.

    .venv/bin/python benchmarks/cpu_prefill_attention.py [--tokens 1024,4096] [--threads 1]
        [--passes 5] [--baseline-tree DIR]

One causal prompt of T tokens with SmolLM2-135M's attention shape (9 query heads, 3 KV heads of
64), in a paged cache of 16-token blocks (blocks in random order), per dtype (fp32, bf16):
kvflow's ``NativeCpuKernels.paged_attention`` through the row-by-row path, the register tiles
(widening 16-bit values to fp32) and, on the bf16 cache of an AVX512-BF16 build, the bf16
dot-product tiles; and ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on
the same contiguous q/k/v. Variants alternate within each pass; each figure is the best pass of
process CPU time (less disturbed by other processes on a shared machine than wall time), FLOPs
counted as 4 * heads * head_dim * T (T + 1) / 2. Prints the load average and CPU with the figures.
With ``--baseline-tree DIR`` (a kvflow source tree, e.g. ``git archive <commit> kvflow | tar -x
-C DIR``) that tree's C kernels (``tree_kernels.py``) run each path too, as ``<path>@base``,
alternating with this tree's, and the line ends with this tree's dot / tiled speedup over it.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import torch
import torch.nn.functional as F
from tree_kernels import kernels_and_baseline

H, HKV, D, BLOCK = 9, 3, 64, 16


def paged_prompt(tokens: int, dtype: torch.dtype) -> dict:
    """q [T, H, D] and a paged cache holding the prompt's keys/values (blocks permuted)."""
    gen = torch.Generator().manual_seed(0)
    nblk = -(-tokens // BLOCK)
    perm = torch.randperm(nblk, generator=gen)
    k, v = torch.randn(2, nblk * BLOCK, HKV, D, generator=gen)
    cache = torch.zeros(2, nblk, BLOCK, HKV, D)
    cache[0, perm] = k.view(nblk, BLOCK, HKV, D)
    cache[1, perm] = v.view(nblk, BLOCK, HKV, D)
    q = torch.randn(tokens, H, D, generator=gen)
    return {"q": q.to(dtype), "cache": cache.to(dtype), "k": k[:tokens].to(dtype),
            "v": v[:tokens].to(dtype), "block_table": perm.to(torch.int32)[None].contiguous(),
            "qsl": torch.tensor([0, tokens], dtype=torch.int32),
            "seq_lens": torch.tensor([tokens], dtype=torch.int32)}


def kernel_variants(p: dict, kernels, suffix: str = "") -> dict:
    """name + suffix -> a call of ``kernels``' path computing the prompt's attention."""
    args = (p["q"], p["cache"], p["qsl"], p["seq_lens"], p["block_table"], D**-0.5)
    out = {"rows": lambda: kernels.paged_attention(*args, validate=False, tiled=False),
           "tiled": lambda: kernels.paged_attention(*args, validate=False, bf16_dot=False)}
    if p["q"].dtype == torch.bfloat16 and kernels.isa in ("avx512_bf16", "amx_bf16"):
        out["dot"] = lambda: kernels.paged_attention(*args, validate=False)
    return {name + suffix: call for name, call in out.items()}


def variants(p: dict, kernels, baseline=None) -> dict:
    """name -> a call computing the prompt's attention (baseline kernels' paths as name@base)."""
    q, k, v = (x.transpose(0, 1)[None] for x in (p["q"], p["k"], p["v"]))
    k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    out = kernel_variants(p, kernels)
    if baseline is not None:
        out.update(kernel_variants(p, baseline, "@base"))
    out["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--baseline-tree", default=None,
                        help="a kvflow source tree whose C kernels run each path too (@base)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels, baseline = kernels_and_baseline(args.baseline_tree)
    model = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], check=False,
                           capture_output=True, text=True).stdout.strip()
    print(f"{model or platform.processor()}; kernels {kernels.isa}; {args.threads} thread(s); "
          f"load {os.getloadavg()}")
    for tokens in map(int, args.tokens.split(",")):
        flops = 4 * H * D * tokens * (tokens + 1) / 2
        for dtype in (torch.float32, torch.bfloat16):
            calls = variants(paged_prompt(tokens, dtype), kernels, baseline)
            best = {name: float("inf") for name in calls}
            for _ in range(args.passes):
                for name, call in calls.items():
                    start = time.process_time()
                    call()
                    best[name] = min(best[name], time.process_time() - start)
            figures = ", ".join(f"{n} {flops / s / 1e9:.0f}" for n, s in best.items())
            fastest = min((s, n) for n, s in best.items() if n != "sdpa" and "@" not in n)
            gains = "".join(f"; {n} {best[n + '@base'] / best[n]:.2f}x baseline"
                            for n in ("dot", "tiled") if n + "@base" in best)
            print(f"T={tokens} {str(dtype)[6:]}: {figures} GFLOP/s; best kvflow path "
                  f"({fastest[1]}) / sdpa time {fastest[0] / best['sdpa']:.2f}{gains}")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
