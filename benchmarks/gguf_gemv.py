"""Per-GEMM CPU time of GGUF weights kept quantized, at decode row counts, kernel by kernel.

    python benchmarks/gguf_gemv.py --types q4_0,q8_0,q4_k,q6_k --rows 1,4,16 --threads 1

For each linear shape of a 1.1B Llama (TinyLlama's q/k/v, o, gate/up, down: K = 2,048 or
5,632, multiples of every GGML block; or ``--shapes NxK`` for others, a type skipped where its
block does not divide K), each GGML type and each row count, the kernels run in
turn (a load spike of a shared machine hits all alike) and the median over ``--repeats``
rounds is reported, in microseconds per call and GB/s of weight bytes read:

* ``native``: kvflow's fused dequantize-and-dot kernel (``csrc/cpu_gguf.c``), the CPU path of
  a GGUF layer up to 16 rows;
* ``torch``: the plain-torch path (``KVFLOW_CPU_GGUF=torch``: dequantize the whole weight
  with torch operators, then ``torch.mm``);
* ``f32``: ``torch.mm`` on the already dequantized fp32 weight (what keeping the blocks
  saves: it reads 4 bytes a weight instead of 0.56-1.06).

The blocks are random bytes with small fp16 scales (the kernels' cost does not depend on the
values). Each call reads a different copy of the weight from a pool larger than the L3 cache,
as a forward pass does at batch 1. Ratios are against ``native``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from quant_gemv import compare

SHAPES = [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048),
          ("down", 2048, 5632)]
TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
F16_AT = {2: (0,), 3: (0, 2), 6: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
POOL_BYTES = 96 << 20  # weights cycled through: three times a 32 MiB L3


def random_blocks(ggml_type: int, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, row_bytes] uint8: random quants, fp16 scales in [-0.05, 0.05]."""
    from kvflow.kernels.gguf_dequant import BLOCK_SHAPES

    elems, nbytes = BLOCK_SHAPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in F16_AT[ggml_type]:
        raw[..., off:off + 2] = rng.uniform(-0.05, 0.05, (n, k // elems, 1)) \
            .astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def make_kernels(ggml_type: int, n: int, k: int, native) -> dict:
    """Per kernel: (call(x, i) on pool entry i, weight bytes read per call)."""
    from kvflow.quant.gguf import gguf_linear

    raw = random_blocks(ggml_type, n, k, seed=ggml_type)
    copies = max(2, POOL_BYTES // raw.numel())
    pool = [raw.clone() for _ in range(copies)]
    dense = native.gguf_dequantize(raw, ggml_type, k)
    copies32 = max(2, POOL_BYTES // (4 * n * k))
    pool32 = [dense.clone() for _ in range(copies32)]
    return {
        "native": (lambda x, i: native.gguf_gemm(x, pool[i % copies], ggml_type, k),
                   raw.numel()),
        "torch": (lambda x, i: gguf_linear(x, pool[i % copies], ggml_type), raw.numel()),
        "f32": (lambda x, i: torch.mm(x, pool32[i % copies32].t()), 4 * n * k),
    }


def parse_shape(name: str) -> tuple[str, int, int]:
    """(name, N, K) of a SHAPES name or of ``NxK``.

    Raises:
        SystemExit: for a name that is neither.
    """
    known = {shape[0]: shape for shape in SHAPES}
    if name in known:
        return known[name]
    n, sep, k = name.partition("x")
    if not (sep and n.isdigit() and k.isdigit()):
        raise SystemExit(f"--shapes: {name!r} is neither one of {sorted(known)} nor NxK")
    return name, int(n), int(k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="q4_0,q8_0,q4_k,q6_k")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", default="native,torch,f32")
    parser.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES),
                        help="names from SHAPES or NxK (576x576: a 135M model's q/o)")
    parser.add_argument("--min-seconds", type=float, default=0.05, help="per timing")
    args = parser.parse_args()
    from kvflow.kernels.cpu_native import native_cpu_kernels
    from kvflow.kernels.gguf_dequant import BLOCK_SHAPES

    torch.set_num_threads(args.threads)
    native = native_cpu_kernels()
    if native is None:
        raise SystemExit("native CPU kernels could not be built")
    print(f"isa {native.isa}, threads {args.threads}, load {os.getloadavg()}", flush=True)
    names = args.kernels.split(",")
    shapes = [parse_shape(name) for name in args.shapes.split(",")]
    for type_name in args.types.split(","):
        for shape, n, k in shapes:
            if k % BLOCK_SHAPES[TYPES[type_name]][0]:
                print(f"{type_name:5s} {shape:8s} skipped: K not a multiple of its block")
                continue
            kernels = make_kernels(TYPES[type_name], n, k, native)
            for m in map(int, args.rows.split(",")):
                cells = compare(kernels, names, torch.randn(m, k), args.repeats,
                                args.min_seconds)
                print(f"{type_name:5s} {shape:8s} {n:6d}x{k:<5d} m={m:<3d} {cells}", flush=True)
            del kernels


if __name__ == "__main__":
    main()
