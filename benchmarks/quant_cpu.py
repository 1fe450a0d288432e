"""CPU cost of each weight quantization, every variant in one process, measured alternately.

    python benchmarks/quant_cpu.py --model SmolLM2-135M-Instruct --rounds 3 \
        --variants fp32,bf16,int8,int8-bf16,int4,gguf,gguf-torch --w1-prompts 64 --out out.json

Per variant (``name``: dtype + ``--quantization``; ``gguf-torch`` is ``gguf`` with
``KVFLOW_CPU_GGUF=torch``, the plain-torch tile path; ``int8-bf16-torch`` is ``int8-bf16``
with ``KVFLOW_CPU_QUANT=torch``, torch's ``_weight_int8pack_mm`` instead of kvflow's INT8
kernel, as ``int4-bf16-torch`` is for its INT8 gate/up and tables), all engines loaded first,
then
``--rounds`` rounds that visit the variants in turn (so a load spike from the other tenants of
a shared machine hits every variant alike) and report medians:

* weight memory: the engine's own count (parameters, buffers, packed GEMM copies);
* batch-1 decode ms/token: one 32-token prompt, 64 greedy tokens (EOS ignored), TPOT =
  (end-to-end - TTFT) / 63 from the request's own metrics;
* CPU-W1 output tok/s (docs/benchmarks.md): ``--w1-prompts`` prompts x 128 random token ids
  (``default_rng(0).integers(3, 32000)``) -> 64 greedy tokens each, prefix caching off, output
  tokens / wall time of the batch; run in the first round only (``--w1-rounds`` to repeat).

Prints a table and ratios against the first variant, and writes ``--out`` JSON. With
``--lock PATH`` the timed rounds run under an exclusive ``flock`` of PATH (taken after loading
and warm-up, so a shared benchmark lock is held only while timing).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import time

VARIANTS = {"fp32": ("float32", None), "bf16": ("bfloat16", None),
            "int8": ("float32", "int8"), "int8-bf16": ("bfloat16", "int8"),
            "int4": ("float32", "int4"), "int4-bf16": ("bfloat16", "int4"),
            "gguf": ("float32", "gguf"), "gguf-torch": ("float32", "gguf"),
            "int8-bf16-torch": ("bfloat16", "int8"), "int4-bf16-torch": ("bfloat16", "int4")}


class Variant:
    """One engine and how to switch the process into its mode."""

    def __init__(self, name: str, model: str, max_num_seqs: int, kv_cache_memory: str,
                 cpu_threads: int | None) -> None:
        from kvflow import LLM

        self.name = name
        dtype, quantization = VARIANTS[name]
        self.llm = LLM(model=model, dtype=dtype, quantization=quantization,
                       enable_prefix_caching=False, kv_cache_memory=kv_cache_memory,
                       cpu_threads=cpu_threads,
                       max_num_seqs=max_num_seqs)
        self.weight_bytes = self.llm.engine.core.weight_bytes

    def activate(self) -> None:
        """Switch the process into this variant's mode (the GGUF and INT8 kernel choices)."""
        os.environ["KVFLOW_CPU_GGUF"] = "torch" if self.name == "gguf-torch" else "native"
        os.environ["KVFLOW_CPU_QUANT"] = "torch" if self.name.endswith("-bf16-torch") \
            else "native"


def decode_ms_per_token(llm, prompt: list[int]) -> float:
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    m = out.metrics
    return (m.e2e_latency - m.ttft) / (len(out.outputs[0].token_ids) - 1) * 1e3


def w1_tok_per_s(llm, prompts: list[list[int]]) -> float:
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--variants", default="fp32,bf16,int8,int8-bf16,int4,gguf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--w1-prompts", type=int, default=64)
    parser.add_argument("--w1-rounds", type=int, default=1)
    parser.add_argument("--kv-cache-memory", default="640MiB", help="per engine")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="threads per engine (default: kvflow's; 1 on a crowded machine "
                             "keeps OpenMP barriers from waiting on descheduled threads)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--lock", default=None, help="flock this file around the timed rounds")
    args = parser.parse_args()
    import numpy as np

    ids = np.random.default_rng(0).integers(3, 32000, (max(args.w1_prompts, 1), 128)).tolist()
    decode_prompt = ids[0][:32]
    variants = [Variant(n, args.model, max(args.w1_prompts, 1), args.kv_cache_memory,
                        args.cpu_threads)
                for n in args.variants.split(",")]
    decode: dict[str, list[float]] = {v.name: [] for v in variants}
    w1: dict[str, list[float]] = {v.name: [] for v in variants}
    for v in variants:  # warm-up: first-call costs (kernel builds, allocations) out of the way
        v.activate()
        v.llm.generate([decode_prompt], use_tqdm=False)
    lock = open(args.lock, "a") if args.lock else None  # noqa: SIM115 (held until the end)
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_EX)
        print(f"holding {args.lock} from {time.strftime('%H:%M:%S')}", flush=True)
    loadavg = [os.getloadavg()]
    for r in range(args.rounds):
        loadavg.append(os.getloadavg())
        for v in variants:
            v.activate()
            decode[v.name].append(decode_ms_per_token(v.llm, decode_prompt))
            if args.w1_prompts and r < args.w1_rounds:
                w1[v.name].append(w1_tok_per_s(v.llm, ids[:args.w1_prompts]))
            print(f"round {r}: {v.name} decode {decode[v.name][-1]:.2f} ms/token"
                  + (f", W1 {w1[v.name][-1]:.1f} tok/s" if len(w1[v.name]) > r else ""),
                  flush=True)
    loadavg.append(os.getloadavg())
    if lock is not None:
        lock.close()  # releases the flock
        print(f"released {args.lock} at {time.strftime('%H:%M:%S')}", flush=True)
    base = variants[0].name
    rows = []
    print(f"\n{args.model}, load average (1/5/15 min) at the start of each round and the end: "
          f"{[tuple(round(x, 1) for x in la) for la in loadavg]}")
    print("variant          weights MiB  decode ms/tok (x base)  W1 out tok/s (x base)")
    for v in variants:
        d = statistics.median(decode[v.name])
        t = statistics.median(w1[v.name]) if w1[v.name] else float("nan")
        d0 = statistics.median(decode[base])
        t0 = statistics.median(w1[base]) if w1[base] else float("nan")
        rows.append({"variant": v.name, "weight_mib": v.weight_bytes / 2**20, "decode_ms": d,
                     "decode_all": decode[v.name], "w1_tok_s": t, "w1_all": w1[v.name]})
        print(f"{v.name:15s} {v.weight_bytes / 2**20:11.1f}  {d:8.2f} (x{d / d0:.2f})"
              f"          {t:8.1f} (x{t / t0:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "rows": rows, "loadavg": loadavg,
                       "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
