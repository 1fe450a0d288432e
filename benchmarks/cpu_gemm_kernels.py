"""GFLOP/s of the CPU GEMM kernels on SmolLM2-135M's GEMM shapes, one thread, by CPU time.

    .venv/bin/python benchmarks/cpu_gemm_kernels.py [--threads 1] [--levels avx512_bf16,avx2]
    .venv/bin/python benchmarks/cpu_gemm_kernels.py --compare [--threads 1] [--rows 1,32,64] \
        [--baseline /path/to/another/checkout] [--onednn-dtype float32] [--shapes 960x576]

For each weight shape and row count: kvflow's C GEMM built for each ISA level this CPU runs
(``KVFLOW_CPU_ISA`` levels; fp32 weights, and bf16 weights - VDPBF16PS pairs on AVX512-BF16,
widened to fp32 elsewhere) and oneDNN's packed GEMM in fp32 and bf16. Each figure is the best
of 5 passes of process CPU time per call (less sensitive to other processes on a shared machine
than wall time; the weight stays in cache, so one-row calls show compute, not memory).

``--compare``: kvflow's bf16 (``--dtype float32``: fp32) GEMM at this CPU's best level (AMX
tiles where it has them) against oneDNN's, both on SmolLM2-135M's five GEMM shapes, per row count: ms per call and the
ratio oneDNN / kvflow (> 1: kvflow faster), the two kernels' passes alternating. Up to 64 rows
the weights cycle through distinct copies larger than the last-level cache (as a model's layers
do in decode, so each call reads its weight from memory); above, two copies (compute-bound, as
``--cpu-gemm auto`` times them). ``--onednn-dtype float32``: oneDNN in fp32 against kvflow's
bf16 (on a CPU without bf16 units oneDNN's bf16 is emulated, several times slower than its
fp32, so fp32 is the one to beat there). One thread by process
CPU time, or ``--threads 2`` by wall time (run it under the bench lock on a quiet machine).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvflow.kernels.cpu_build import isa_levels_for_cpu
from kvflow.kernels.cpu_native import native_cpu_kernels_for_isa

SHAPES = [(3072, 576), (576, 1536), (8192, 576)]  # gate_up, down, a slice of the LM head
ROWS = (1, 16, 64, 256)


def cpu_seconds(fn, reps: int) -> float:
    """Best of 5 passes of ``reps`` calls, process CPU time per call."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - start) / reps)
    return best


def kernels_of(n: int, k: int, m: int, levels) -> dict[str, float]:
    """Seconds per call of every kernel on an [n, k] weight and m rows."""
    res = {}
    reps = max(3, 2000 // (m * 8))
    for dt in (torch.float32, torch.bfloat16):
        w = torch.randn(n, k).to(dt)
        for name, kern in levels.items():
            packed = kern.gemm_pack(w)
            x = torch.randn(m, k).to(kern.gemm_x_dtype(dt))
            res[f"{name}/{str(dt)[6:]}"] = cpu_seconds(
                lambda kern=kern, x=x, packed=packed: kern.gemm(x, packed, n), reps)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        x = torch.randn(m, k).to(dt)
        res[f"onednn/{str(dt)[6:]}"] = cpu_seconds(
            lambda x=x, onednn=onednn: torch.ops.mkldnn._linear_pointwise(
                x, onednn, None, "none", [], ""), reps)
    return res


MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)]  # (n, k)
STREAM_BYTES = 160 << 20  # weights cycled per timing: more than the 105 MB L3 of the AMX Xeon
STREAM_ROWS = 64  # up to this many rows a call streams its weight (decode); above, two copies


def imported_checkout() -> Path:
    """The checkout kvflow is imported from (PYTHONPATH, else the environment's install)."""
    import kvflow

    return Path(kvflow.__file__).resolve().parent.parent


def baseline_kernels(root: str):
    """kvflow's kernels built (same ISA level) from the C sources of another checkout at
    ``root`` (e.g. ``git worktree add /tmp/base <commit>``): an A/B of kernel versions.

    Raises SystemExit when ``root`` is the checkout kvflow is imported from (a second worktree
    sharing one virtual environment imports the environment's checkout unless PYTHONPATH names
    its own: both sides would then be the same code)."""
    from kvflow.kernels import cpu_build, cpu_native

    if imported_checkout() == Path(root).resolve():
        raise SystemExit(f"--baseline {root} is the checkout kvflow is imported from, so both "
                         "sides would run the same kernels; run this script with "
                         "PYTHONPATH=<the checkout to measure>")
    level = next(lv for lv in cpu_build.isa_levels_for_cpu()
                 if lv.name == cpu_native.native_cpu_kernels().isa)
    csrc = Path(root) / "kvflow/kernels/csrc"
    sources = [csrc / src for src in cpu_build.SOURCES if (csrc / src).exists()]
    headers = cpu_build.HEADERS  # an older checkout lacks the newer headers
    cpu_build.HEADERS = tuple(h for h in headers if (csrc / h).exists())
    try:
        return cpu_native._load(cpu_native._compiler(), sources, level)
    finally:
        cpu_build.HEADERS = headers


def compare(rows_list: list[int], threads: int, passes: int = 5, baseline: str = "",
            dtype: torch.dtype = torch.bfloat16, onednn_dtype: torch.dtype | None = None,
            shapes: list[tuple[int, int]] | None = None) -> None:
    """Prints kvflow's ``dtype`` GEMM against oneDNN's in ``onednn_dtype`` (None: ``dtype``;
    and, with ``baseline``, kvflow's kernels built from that checkout's sources), per shape of
    ``shapes`` (None: MODEL_SHAPES) and row count (see the module docstring), and the geometric
    mean ratio per row count."""
    from kvflow.kernels.cpu_native import native_cpu_kernels

    kernels = native_cpu_kernels()
    base = baseline_kernels(baseline) if baseline else None
    clock = time.process_time if threads == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    onednn_dtype = onednn_dtype or dtype
    print(f"kvflow ({kernels.isa}) {dtype} vs oneDNN {onednn_dtype}, {threads} thread(s), "
          f"{'CPU' if threads == 1 else 'wall'} time, min of {passes} passes")
    if base is not None:
        print(f"kvflow: {imported_checkout()}; baseline: {baseline}")
    extra = " baseline ms | baseline / kvflow |" if base else ""
    print(f"| n x k | rows | kvflow ms | oneDNN ms | oneDNN / kvflow |{extra}")
    print("|---|---|---|---|---|" + ("---|---|" if base else ""))
    ratios: dict[int, list[float]] = {m: [] for m in rows_list}
    for n, k in shapes or MODEL_SHAPES:
        copies = max(2, min(256, STREAM_BYTES // (n * k * 2)))
        w = torch.randn(n, k, generator=gen).to(dtype)
        fns = {"kvflow": [], "onednn": []}
        for _ in range(copies):
            packed = kernels.gemm_pack(w)
            fns["kvflow"].append(lambda x, p=packed, n=n: kernels.gemm(x, p, n, None, dtype))
            od = torch.ops.mkldnn._reorder_linear_weight(w.to(onednn_dtype), 64)
            fns["onednn"].append(lambda x, od=od: torch.ops.mkldnn._linear_pointwise(
                x, od, None, "none", [], ""))
            if base is not None:
                bp = base.gemm_pack(w)
                fns.setdefault("baseline", []).append(
                    lambda x, p=bp, n=n: base.gemm(x, p, n, None, dtype))
        for m in rows_list:
            x = torch.randn(m, k, generator=gen).to(dtype)
            xs = {"onednn": x.to(onednn_dtype)}
            best = {}
            for name, pool in fns.items():
                pool = pool if m <= STREAM_ROWS else pool[:2]
                pool[0](xs.get(name, x))
                best[name] = float("inf")
            for _ in range(passes):
                for name, pool in fns.items():
                    pool = pool if m <= STREAM_ROWS else pool[:2]
                    xn = xs.get(name, x)
                    start = clock()
                    for fn in pool:
                        fn(xn)
                    best[name] = min(best[name], (clock() - start) / len(pool))
            ratio = best["onednn"] / best["kvflow"]
            ratios[m].append(ratio)
            row = f"| {n}x{k} | {m} | {best['kvflow'] * 1e3:.3f} | {best['onednn'] * 1e3:.3f} " \
                  f"| {ratio:.2f}x |"
            if base is not None:
                row += f" {best['baseline'] * 1e3:.3f} | {best['baseline'] / best['kvflow']:.2f}x |"
            print(row, flush=True)
    for m, rs in ratios.items():
        gmean = torch.tensor(rs).log().mean().exp().item()
        print(f"rows {m}: geometric mean oneDNN / kvflow {gmean:.2f}x over {len(rs)} shapes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--levels", default=",".join(lv.name for lv in isa_levels_for_cpu()[:2]))
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--rows", default="1,32,64,128,256,512")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--baseline", default="", help="--compare: also time kvflow's kernels "
                        "built from this checkout's sources")
    parser.add_argument("--onednn-dtype", default="", choices=["", "bfloat16", "float32"],
                        help="--compare: oneDNN's dtype (default: --dtype's), e.g. float32 "
                        "against kvflow's bf16 on a CPU without bf16 units")
    parser.add_argument("--shapes", default="", help="--compare: n x k shapes, e.g. "
                        "960x576,3072x576 (default: SmolLM2-135M's five)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.compare:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] \
            if args.shapes else None
        compare([int(r) for r in args.rows.split(",")], args.threads, baseline=args.baseline,
                dtype=getattr(torch, args.dtype),
                onednn_dtype=getattr(torch, args.onednn_dtype) if args.onednn_dtype else None,
                shapes=shapes)
        return
    levels = {name: native_cpu_kernels_for_isa(name) for name in args.levels.split(",")}
    levels = {name: k for name, k in levels.items() if k is not None}
    for n, k in SHAPES:
        for m in ROWS:
            res = kernels_of(n, k, m, levels)
            flops = 2 * m * n * k
            print(f"{n}x{k} m={m}: " + ", ".join(f"{a} {flops / s / 1e9:.0f}"
                                                  for a, s in res.items()) + " GFLOP/s")


if __name__ == "__main__":
    main()
