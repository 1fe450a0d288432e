"""The CPU GEMMs' time inside a real CPU-W1 run against the same packed weights timed alone
(issue 23: is the in-engine GEMM gap real?).

    .venv/bin/python benchmarks/cpu_gemm_in_engine.py out/smollm2-hf bfloat16 [--rounds 2]

Workload CPU-W1 (64 x 128 random token ids -> 64 greedy tokens, EOS ignored, prefix caching
off) after a two-prompt warm-up. Rounds alternate between a plain run and a run with the leaf
GEMM calls (``NativePackedWeight`` / ``OneDnnPackedWeight.__call__``) wrapped by
``time.perf_counter`` (one wrapper per call, no nesting), so the wrapper's own cost shows as the
difference of the two runs' wall times. Then every (kernel, n x k, rows) class seen in the
engine is timed alone on the very packed weight object the engine used, at the engine's thread
count, by wall time: the same number of calls back to back with fresh inputs of those rows.
"""

from __future__ import annotations

import argparse
import collections
import resource
import statistics
import time

from kvflow import LLM, SamplingParams  # before torch: kvflow's OpenMP settings apply


def wrap_leaf_gemms(times: collections.Counter, calls: collections.Counter, objs: dict,
                    faults: collections.Counter):
    """Patch the leaf packed-GEMM classes (wall time, calls, one object and the minor page
    faults per (kernel, n, k, rows)); returns a function that restores them."""
    from kvflow.kernels import gemm

    originals = {cls: cls.__call__ for cls in (gemm.NativePackedWeight, gemm.OneDnnPackedWeight)}

    def make(cls, fn):
        kind = "native" if cls is gemm.NativePackedWeight else "onednn"

        def wrapper(self, x, bias=None, out_dtype=None):
            flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            out = fn(self, x, bias, out_dtype)
            elapsed = time.perf_counter() - start
            flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt
            rows = x.numel() // x.shape[-1]
            key = (kind, out.shape[-1], x.shape[-1], rows)
            times[key] += elapsed
            calls[key] += 1
            faults[key] += flt
            objs.setdefault(key, (self, x.dtype, out_dtype))
            return out

        return wrapper

    for cls, fn in originals.items():
        cls.__call__ = make(cls, fn)

    def restore() -> None:
        for cls, fn in originals.items():
            cls.__call__ = fn

    return restore


def isolated_seconds(obj, dtype, out_dtype, k: int, rows: int, reps: int) -> float:
    """Wall seconds per call of ``obj`` on fresh [rows, k] inputs, best of 3 passes."""
    import torch

    x = torch.randn(rows, k).to(dtype)
    obj(x, None, out_dtype)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            obj(x, None, out_dtype)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("dtype")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-gemm", default=None)
    args = parser.parse_args()
    import numpy as np
    import torch

    options = {} if args.cpu_gemm is None else {"cpu_gemm": args.cpu_gemm}
    llm = LLM(model=args.model_dir, dtype=args.dtype, enable_prefix_caching=False,
              kv_cache_memory="1GiB", **options)
    ids = np.random.default_rng(0).integers(3, 32000, (64, 128)).tolist()
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate(ids[:2], params(4), use_tqdm=False)
    walls: dict[str, list[float]] = {"plain": [], "wrapped": []}
    times: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    objs: dict = {}
    faults: collections.Counter = collections.Counter()
    for _ in range(args.rounds):
        for mode in ("plain", "wrapped"):
            times.clear()
            calls.clear()
            faults.clear()
            restore = wrap_leaf_gemms(times, calls, objs, faults) if mode == "wrapped" else None
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            llm.generate(ids, params(64), use_tqdm=False)
            walls[mode].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            print(f"{mode}: wall {walls[mode][-1]:.2f} s, user {after.ru_utime - before.ru_utime:.2f}"
                  f" s, sys {after.ru_stime - before.ru_stime:.2f} s, minor faults "
                  f"{after.ru_minflt - before.ru_minflt}, voluntary switches "
                  f"{after.ru_nvcsw - before.ru_nvcsw}, involuntary "
                  f"{after.ru_nivcsw - before.ru_nivcsw}", flush=True)
            if restore:
                restore()
    plain, wrapped = statistics.median(walls["plain"]), statistics.median(walls["wrapped"])
    gemm_total = sum(times.values())
    print(f"threads {torch.get_num_threads()}; wall plain {plain:.2f} s, wrapped {wrapped:.2f} s "
          f"(medians of {args.rounds}; last wrapped run's GEMMs {gemm_total:.2f} s)")
    print("| kernel | n x k | rows | calls | engine ms/call | alone ms/call | engine/alone "
          "| engine - alone us | engine GFLOP/s | page faults/call |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    engine_sum = alone_sum = 0.0
    for key in sorted(times, key=lambda kk: -times[kk]):
        kind, n, k, rows = key
        per = times[key] / calls[key]
        if times[key] < 0.005 * gemm_total:
            continue
        obj, dtype, out_dtype = objs[key]
        alone = isolated_seconds(obj, dtype, out_dtype, k, rows, calls[key])
        engine_sum += times[key]
        alone_sum += alone * calls[key]
        print(f"| {kind} | {n}x{k} | {rows} | {calls[key]} | {per * 1e3:.3f} | "
              f"{alone * 1e3:.3f} | {per / alone:.2f} | {(per - alone) * 1e6:.0f} | {2 * rows * n * k / per / 1e9:.0f} | "
              f"{faults[key] / calls[key]:.0f} |",
              flush=True)
    print(f"classes shown: engine {engine_sum:.3f} s, alone {alone_sum:.3f} s "
          f"({engine_sum / alone_sum:.2f}x)")


if __name__ == "__main__":
    main()
