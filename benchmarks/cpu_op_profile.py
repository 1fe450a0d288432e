"""Where a kvflow CPU run spends its time, per op class (issue 23): each GEMM shape at decode and
prefill row counts, prefill and decode attention, the K/V store, norms / rotary / activation,
the embedding, the LM head, sampling and the host side of a step (engine time outside them).

    .venv/bin/python benchmarks/cpu_op_profile.py out/smollm2-hf bfloat16 [--prompts 64] [--enforce-eager]

Workload CPU-W1 of docs/benchmarks.md (64 x 128 random token ids -> 64 greedy tokens, EOS
ignored, prefix caching off), one batch after a two-prompt warm-up. Each op is timed by
wrapping its Python entry point with ``time.perf_counter`` (the kernels run synchronously on
CPU), so an op's figure includes its Python call overhead; "host" is the wall time of
``LLM.generate`` minus every timed op. Wrapping adds ~1 us per call (~40 k calls here).
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

TIMES: collections.Counter = collections.Counter()
CLOCK = [time.perf_counter]
CALLS: collections.Counter = collections.Counter()
_DEPTH = [0]


def _timed(key_fn, fn):
    """``fn`` with its wall time added to TIMES[key_fn(args)]; nested timed calls are not
    counted twice (only the outermost one counts)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _DEPTH[0]:
            return fn(*args, **kwargs)
        _DEPTH[0] += 1
        start = CLOCK[0]()
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
            key = key_fn(*args, **kwargs)
            TIMES[key] += CLOCK[0]() - start
            CALLS[key] += 1

    return wrapper


def _rows(x) -> str:
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    return "decode" if rows <= 64 else "prefill"


def _patch() -> None:
    """Wrap the op entry points (classes patched in place; the engine is built afterwards)."""
    from kvflow.attention.torch_paged import TorchPagedAttentionBackend as T
    from kvflow.kernels import gemm
    from kvflow.kernels.cpu_native import NativeCpuKernels as K
    from kvflow.layers.embedding import VocabParallelEmbedding
    from kvflow.layers.sampler import Sampler

    def gemm_key(kind):
        return lambda self, x, bias=None, out_dtype=None: (
            f"gemm {kind} {_n(self)}x{x.shape[-1]} {_rows(x)}")

    def _n(self):
        return getattr(self, "out_features", None) or self.packed.shape[0]

    gemm.NativePackedWeight.__call__ = _timed(gemm_key("native"), gemm.NativePackedWeight.__call__)
    gemm.OneDnnPackedWeight.__call__ = _timed(gemm_key("onednn"), gemm.OneDnnPackedWeight.__call__)
    K.paged_attention = _timed(
        lambda self, q, *a, **k: "attention " + ("decode" if q.shape[0] <= 64 else "prefill/mixed"),
        K.paged_attention)
    T.uniform_prompt_attention = staticmethod(_timed(lambda *a, **k: "attention prefill (SDPA)",
                                                     T.uniform_prompt_attention))
    T.store_kv = staticmethod(_timed(lambda *a, **k: "kv store", T.store_kv))
    K.rms_norm = _timed(lambda self, x, *a, **k: f"rms_norm {_rows(x)}", K.rms_norm)
    K.silu_and_mul = _timed(lambda self, x, *a, **k: f"silu_and_mul {_rows(x)}", K.silu_and_mul)
    K.rotary = _timed(lambda self, pos, q, *a, **k: f"rotary {'decode' if q.shape[0] <= 64 else 'prefill'}", K.rotary)
    VocabParallelEmbedding.forward = _timed(lambda *a, **k: "embedding",
                                            VocabParallelEmbedding.forward)
    Sampler.__call__ = _timed(lambda *a, **k: "sampler", Sampler.__call__)


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """The CPU-W1 command line shared with cpu_thread_scaling.py: ``MODEL_DIR DTYPE
    [--prompts 64] [--input-len 128] [--output-len 64]`` (``doc``: the script's docstring, its
    first line the description)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("dtype")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    return parser


def main() -> None:
    parser = workload_parser(__doc__)
    parser.add_argument("--cpu-gemm", default=None)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CPU step graphs, so every decode op is timed (a replayed "
                             "graph's ops count as host time)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time (all threads; with OMP_NUM_THREADS=1 the "
                             "op's compute cost, little disturbed by other processes)")
    args = parser.parse_args()
    from kvflow import LLM, SamplingParams

    _patch()
    import numpy as np

    options = {} if args.cpu_gemm is None else {"cpu_gemm": args.cpu_gemm}
    if args.enforce_eager:
        options["enforce_eager"] = True
    llm = LLM(model=args.model_dir, dtype=args.dtype, enable_prefix_caching=False,
              kv_cache_memory="1GiB", **options)
    ids = np.random.default_rng(0).integers(3, 32000, (args.prompts, args.input_len)).tolist()
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate(ids[:2], params(4), use_tqdm=False)
    TIMES.clear()
    CALLS.clear()
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    start, wall_start = CLOCK[0](), time.perf_counter()
    outs = llm.generate(ids, params(args.output_len), use_tqdm=False)
    wall, real = CLOCK[0]() - start, time.perf_counter() - wall_start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.dtype}: {produced / real:.1f} out tok/s, wall {real:.2f} s, "
          f"{args.clock} clock total {wall:.2f} s")
    print("| op | calls | s | % of total | us/call |")
    print("|---|---|---|---|---|")
    for key, s in sorted(TIMES.items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {CALLS[key]} | {s:.3f} | {100 * s / wall:.1f} | "
              f"{1e6 * s / CALLS[key]:.0f} |")
    host = wall - sum(TIMES.values())
    print(f"| host (rest of the total) | - | {host:.3f} | {100 * host / wall:.1f} | - |")


if __name__ == "__main__":
    main()
