"""A 16-bit LM head packed for kvflow's C GEMM without its plain table (the embedding of a tied
head reads its rows from the packed copy) against the same engine with the plain table: weight
MiB, batch-1 decode time per token and batch-64 throughput.

    flock /work/notes/bench.lock python benchmarks/tied_head_memory.py \
        --model SmolLM2-135M-Instruct --rounds 8

One engine (kvflow's default: the plain table freed); "keep" gives its tied embedding the plain
table back (rebuilt from the packed rows, looked up by ``F.embedding`` as before), "drop"
empties it again, alternated round by round in the one process, so the two differ only in the
lookup (the head multiplies the same packed copy either way; two engines in one process would
share the cores between their GEMM thread pools). Weight MiB of each: ``weight_bytes`` with
and without the plain table. Prints medians over the rounds and the drop/keep ratios (above 1:
drop faster), by wall time and by the process's CPU time (the steadier of the two on a shared
machine). Results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

PROMPT = "The history of the printing press begins"


def set_plain_table(llm: Any, keep: bool, saved: dict[bool, tuple]) -> int:
    """Give the tied embedding its plain table back (``keep``) or empty it; returns the
    engine's weight bytes then (the plain table counted while kept). Each variant keeps its
    table and its own CPU step graphs in ``saved`` (a replay calls the kernels on the
    addresses it recorded, so graphs recorded with the other table must not run)."""
    from kvflow.quant import weight_bytes

    core = llm.engine.core
    runner = core.executor.runner
    embed = runner.model.model.embed_tokens
    saved[embed.weight.numel() > 0] = (embed.weight, runner.graph_runner)
    if keep not in saved:
        packed = embed.packed_weight
        rows = packed.rows(torch.arange(packed.out_features)) if keep else \
            embed.weight.new_empty(0, packed.in_features)
        embed.weight = torch.nn.Parameter(rows, requires_grad=False)
        core.executor.capture_graphs(core.max_model_len)  # a fresh runner, nothing recorded
    else:
        embed.weight, runner.graph_runner = saved[keep]
    return weight_bytes(runner.model)


def decode_ms_per_token(llm: Any, tokens: int) -> float:
    """One request, greedy: (end-to-end - TTFT) / (tokens - 1), milliseconds."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return (out.metrics.e2e_latency - out.metrics.ttft) / (tokens - 1) * 1e3


def batch_tokens_per_s(llm: Any, batch: int, tokens: int) -> float:
    """``batch`` distinct requests at once, greedy: generated tokens per wall second."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"{PROMPT} ({i})" for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    from kvflow import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=8)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype="bfloat16", device="cpu", max_num_seqs=args.batch,
              kv_cache_memory="256MiB", max_model_len=512)
    if llm.engine.core.executor.runner.model.model.embed_tokens.weight.numel():
        raise SystemExit("the plain table was not freed (not a tied head packed natively?)")
    keys = ("decode_ms", "decode_cpu_ms", "batch_tok_s", "batch_cpu_tok_s")
    results: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys}
                                                   for n in ("keep", "drop")}
    saved: dict[bool, tuple] = {}
    for name in results:
        mib = set_plain_table(llm, name == "keep", saved) / 2**20
        print(f"{name}: weights {mib:.1f} MiB")
        decode_ms_per_token(llm, 8)  # warm up both paths
        batch_tokens_per_s(llm, 8, 4)
    for r in range(args.rounds):
        for name in (("keep", "drop") if r % 2 == 0 else ("drop", "keep")):
            set_plain_table(llm, name == "keep", saved)
            got = results[name]
            cpu = time.process_time()
            got["decode_ms"].append(decode_ms_per_token(llm, args.decode_tokens))
            got["decode_cpu_ms"].append((time.process_time() - cpu) / args.decode_tokens * 1e3)
            cpu = time.process_time()
            got["batch_tok_s"].append(batch_tokens_per_s(llm, args.batch, args.batch_tokens))
            got["batch_cpu_tok_s"].append(args.batch * args.batch_tokens
                                          / (time.process_time() - cpu))
        print(f"round {r}: " + ", ".join(
            f"{n} {v['decode_ms'][-1]:.2f} ms/token {v['batch_tok_s'][-1]:.1f} tok/s"
            for n, v in results.items()), flush=True)
    med = {n: {k: statistics.median(v[k]) for k in keys} for n, v in results.items()}
    for n, m in med.items():
        print(f"{n}: batch-1 decode {m['decode_ms']:.2f} ms/token ({m['decode_cpu_ms']:.2f} "
              f"CPU ms), batch-{args.batch} {m['batch_tok_s']:.1f} tokens/s "
              f"({m['batch_cpu_tok_s']:.1f} per CPU s); medians")
    k, d = med["keep"], med["drop"]
    print(f"drop/keep (above 1: drop faster): batch-1 decode {k['decode_ms'] / d['decode_ms']:.3f}x"
          f" wall, {k['decode_cpu_ms'] / d['decode_cpu_ms']:.3f}x CPU; batch-{args.batch} "
          f"{d['batch_tok_s'] / k['batch_tok_s']:.3f}x wall, "
          f"{d['batch_cpu_tok_s'] / k['batch_cpu_tok_s']:.3f}x CPU")


if __name__ == "__main__":
    main()
