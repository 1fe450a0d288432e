"""Per-GEMM CPU time of weight-only INT8 against bf16 at decode row counts, kernel by kernel.

    python benchmarks/quant_gemv.py --model smollm2 --rows 1,4,16,64 --threads 1 --repeats 7

For each linear shape of the model (q/k/v, o, gate/up, down, LM head) and each row count, the
kernels run in turn (so a load spike of a shared machine hits all alike) and the median over
``--repeats`` rounds is reported, in microseconds per call and GB/s of weight read:

* ``bf16``: kvflow's packed native GEMM on a bf16 weight (the unquantized bf16 model's path);
* ``int8-torch``: torch's ``_weight_int8pack_mm`` on bf16 activations (``KVFLOW_CPU_QUANT=torch``);
* ``int8``: kvflow's native INT8 kernel (``csrc/cpu_quant_gemm.c``), bf16 in and out;
* ``int8-f32``: the same kernel with fp32 activations and output (the INT8 LM head's logits);
* ``int8-g64``: the same kernel with group scales [N, K / 64] (GPTQ 8-bit, W8A16 groups);
* ``int4-torch``: torch's ``_weight_int4pack_mm_for_cpu`` (group 32, bf16 activations), the
  path of ``--quantization int4``'s INT4 projections.

Each call reads a different copy of the weight from a pool larger than the L3 cache (as a
forward pass does: every layer's weight comes from memory at batch 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SHAPES = {  # (name, N, K) per model
    "smollm2": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                ("down", 576, 1536), ("lm_head", 49152, 576)],
    "qwen0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896),
                 ("down", 896, 4864), ("lm_head", 151936, 896)],
}
POOL_BYTES = 96 << 20  # weights cycled through: three times this CPU's 32 MiB L3


def make_kernels(n: int, k: int, kernels) -> dict:
    """Per kernel: (call(x, i) using pool entry i, pool size, weight bytes per call)."""
    from kvflow.kernels.cpu_quant import int8_gemm
    from kvflow.quant.int4 import quantize_int4_groupwise
    from kvflow.quant.int8 import quantize_int8_per_channel

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    q, s = quantize_int8_per_channel(w)
    copies = max(2, POOL_BYTES // (n * k))
    qs = [q.clone() for _ in range(copies)]
    copies_bf16 = max(2, POOL_BYTES // (2 * n * k))
    packed = [kernels.gemm_pack(w.bfloat16()) for _ in range(copies_bf16)]
    s16 = s.bfloat16()
    sg = (w.view(n, k // 64, 64).abs().amax(-1) / 127).contiguous()  # group scales, G = 64
    q4, s4, z4 = quantize_int4_groupwise(w, 32)
    copies4 = max(2, POOL_BYTES // (n * k // 2))
    torch4 = [torch._convert_weight_to_int4pack_for_cpu(q4, 1) for _ in range(copies4)]
    sz_torch = torch.stack([s4.t(), z4.t()], dim=-1).bfloat16().contiguous()
    return {
        "bf16": (lambda x, i: kernels.gemm(x, packed[i % len(packed)], n).bfloat16(), 2 * n * k),
        "int8-torch": (lambda x, i: torch._weight_int8pack_mm(x, qs[i % copies], s16), n * k),
        "int8": (lambda x, i: int8_gemm(kernels, x, qs[i % copies], s), n * k),
        "int8-g64": (lambda x, i: int8_gemm(kernels, x, qs[i % copies], sg), n * k),
        "int8-f32": (lambda x, i: int8_gemm(kernels, x.float(), qs[i % copies], s,
                                            out_dtype=torch.float32), n * k),
        "int4-torch": (lambda x, i: torch._weight_int4pack_mm_for_cpu(
            x, torch4[i % copies4], 32, sz_torch), n * k // 2),
    }


def time_call(fn, x: torch.Tensor, calls: int, start: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn(x, start + i)
    return (time.perf_counter() - t0) / calls


def compare(kernels: dict, names: list[str], x: torch.Tensor, repeats: int,
            min_seconds: float) -> str:
    """Time ``kernels[name] = (call(x, i), weight bytes per call)`` for each of ``names`` in
    turn, ``repeats`` rounds (calls per timing from a first estimate, so one timing lasts about
    ``min_seconds``); one line of cells: median microseconds per call, GB/s of weight read,
    and the time over the first kernel's."""
    calls = {}
    for name in names:  # warm-up, and calls per timing from a first estimate
        est = time_call(kernels[name][0], x, 3, 0)
        calls[name] = max(3, int(min_seconds / max(est, 1e-7)))
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names:
            times[name].append(time_call(kernels[name][0], x, calls[name], r * 1000))
    base = statistics.median(times[names[0]])
    cells = []
    for name in names:
        t = statistics.median(times[name])
        gbs = kernels[name][1] / t / 1e9
        cells.append(f"{name} {t * 1e6:9.1f} us {gbs:5.1f} GB/s x{t / base:5.2f}")
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernels",
                        default="bf16,int8-torch,int8,int8-g64,int8-f32,int4-torch")
    parser.add_argument("--min-seconds", type=float, default=0.05, help="per timing")
    args = parser.parse_args()
    from kvflow.kernels.cpu_native import native_cpu_kernels

    torch.set_num_threads(args.threads)
    native = native_cpu_kernels()
    print(f"isa {native.isa}, threads {args.threads}, load {os.getloadavg()}", flush=True)
    names = args.kernels.split(",")
    for shape, n, k in SHAPES[args.model]:
        kernels = make_kernels(n, k, native)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            cells = compare(kernels, names, x, args.repeats, args.min_seconds)
            print(f"{shape:8s} {n:6d}x{k:<5d} m={m:<3d} {cells}", flush=True)
        del kernels


if __name__ == "__main__":
    main()
