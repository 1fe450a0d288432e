"""Nanoseconds per element of kvflow's native row-wise CPU kernels, this tree vs another.

    .venv/bin/python benchmarks/cpu_elementwise_kernels.py --baseline-tree DIR [--rows 2048,64]
        [--threads 1] [--passes 7] [--dtypes bfloat16] [--extra] [--ops a,b]

SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, neox rotary
over all 64 dims): RMSNorm, RMSNorm with the residual add, SiLU-and-mul, rotary and, with
``--extra``, GELU-and-mul in the erf form (GeGLU with approximate="none") and a soft-capped
decode attention step (``--rows`` requests of 1 query token, ``CONTEXT`` cached keys each,
Gemma 2's cap 50; elements: scores, heads x keys; torch's yardstick: the cap alone, ``cap *
torch.tanh(s / cap)`` over as many scores), at each ``--rows`` (2,048: a prefill chunk; 64: a CPU-W1 decode step), through this tree's
``NativeCpuKernels`` and the C kernels of ``--baseline-tree`` (``benchmarks/tree_kernels.py``),
alternating in every pass, with torch's plain ops as a yardstick. Each figure is the best pass
of process CPU time (little disturbed by other processes); each pass runs enough calls for
~50 ms. Elements: the op's output elements (rotary: q and k together). Prints the load average
and the CPU with the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch
import torch.nn.functional as F
from tree_kernels import tree_kernels

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.layers.rotary import RotaryEmbedding

HIDDEN, INTER, H, HKV, D = 576, 1536, 9, 3, 64
CONTEXT, BLOCK, CAP = 512, 16, 50.0


def softcap_decode(kernels, rows: int, dtype: torch.dtype, gen: torch.Generator):
    """(a soft-capped decode attention call through ``kernels``, or the cap alone in torch
    when None, scores per call): ``rows`` requests of CONTEXT keys."""
    if kernels is None:
        s = torch.randn(rows * H, CONTEXT, generator=gen) * 20
        return lambda: CAP * torch.tanh(s / CAP), rows * H * CONTEXT
    per_req = CONTEXT // BLOCK
    cache = torch.randn(2, rows * per_req, BLOCK, HKV, D, generator=gen).to(dtype)
    q = (torch.randn(rows, H, D, generator=gen) * 4).to(dtype)
    qsl = torch.arange(rows + 1, dtype=torch.int32)
    lens = torch.full((rows,), CONTEXT, dtype=torch.int32)
    table = torch.arange(rows * per_req, dtype=torch.int32).view(rows, per_req)
    return (lambda: kernels.paged_attention(q, cache, qsl, lens, table, D**-0.5,
                                            validate=False, softcap=CAP),
            rows * H * CONTEXT)


def ops(kernels, rows: int, dtype: torch.dtype, extra: bool = False) -> dict:
    """op name -> (a call through ``kernels`` or torch when None, output elements)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    res = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    w = torch.rand(HIDDEN, generator=gen).to(dtype)
    gu = (torch.randn(rows, 2 * INTER, generator=gen) * 3).to(dtype)
    qkv = torch.randn(rows, (H + 2 * HKV) * D, generator=gen).to(dtype)
    q, k = qkv[:, :H * D].view(rows, H, D), qkv[:, H * D:(H + HKV) * D].view(rows, HKV, D)
    rope = RotaryEmbedding(D, 4096, 10000.0)
    pos = torch.randint(0, 4096, (rows,), generator=gen)
    table = extra_ops(kernels, rows, dtype, gen) if extra else {}
    if kernels is None:
        def rms(t):
            tf = t.float()
            return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
        return table | {"rms_norm": (lambda: rms(x), rows * HIDDEN),
                "rms_norm+residual": (lambda: rms(x + res), rows * HIDDEN),
                "silu_and_mul": (lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:], rows * INTER),
                "rotary": (lambda: rope.forward_native(pos, q, k), rows * (H + HKV) * D)}
    cache = rope.cos_sin_cache
    return table | {"rms_norm": (lambda: kernels.rms_norm(x, w, 1e-5), rows * HIDDEN),
            "rms_norm+residual": (lambda: kernels.rms_norm(x, w, 1e-5, res), rows * HIDDEN),
            "silu_and_mul": (lambda: kernels.silu_and_mul(gu), rows * INTER),
            "rotary": (lambda: kernels.rotary(pos, q, k, cache, True), rows * (H + HKV) * D)}


def extra_ops(kernels, rows: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """``--extra``: GELU-and-mul (erf form) and the soft-capped decode attention step."""
    gu = (torch.randn(rows, 2 * INTER, generator=gen) * 3).to(dtype)
    gelu = (lambda: F.gelu(gu[:, :INTER]) * gu[:, INTER:]) if kernels is None else \
        (lambda: kernels.gelu_and_mul(gu, "none"))
    return {"gelu_and_mul(erf)": (gelu, rows * INTER),
            "softcap_decode": softcap_decode(kernels, rows, dtype, gen)}


def best_ns(call, elements: int, reps: int) -> float:
    start = time.process_time()
    for _ in range(reps):
        call()
    return (time.process_time() - start) / reps / elements * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", required=True)
    parser.add_argument("--rows", default="2048,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--extra", action="store_true",
                        help="also GELU-and-mul (erf) and soft-capped decode attention")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new = native_cpu_kernels()
    if new is None:
        raise SystemExit("native CPU kernels unavailable")
    old = tree_kernels(args.baseline_tree)
    model = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], check=False,
                           capture_output=True, text=True).stdout.strip()
    print(f"{model}; kernels {new.isa}; {args.threads} thread(s); load {os.getloadavg()}")
    print("| dtype | rows | op | baseline ns/elem | this tree ns/elem | torch ns/elem | "
          "this / baseline time |")
    print("|---|---|---|---|---|---|---|")
    for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
        for rows in map(int, args.rows.split(",")):
            variants = {v: ops(k, rows, dtype, args.extra)
                        for v, k in (("baseline", old), ("new", new), ("torch", None))}
            for name in variants["new"]:
                if args.ops and name not in args.ops.split(","):
                    continue
                elements = variants["new"][name][1]
                reps = max(3, int(5e7 / elements))  # ~50 ms at ~1 ns per element
                best = dict.fromkeys(variants, float("inf"))
                for _ in range(args.passes):
                    for v, table in variants.items():
                        best[v] = min(best[v], best_ns(table[name][0], elements, reps))
                print(f"| {str(dtype)[6:]} | {rows} | {name} | {best['baseline']:.3f} | "
                      f"{best['new']:.3f} | {best['torch']:.3f} | "
                      f"{best['new'] / best['baseline']:.2f} |")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
