"""Context parallelism on CPU: per-rank dense work of a long prompt's prefill with Ring
Attention (``--context-parallel-prefill ring``) against the replicated prefill (every rank
runs every token), CP=2, alternating the variants within one run.

    .venv/bin/python benchmarks/cp_ring.py --model SmolLM2-135M-Instruct --input-len 1536 \
        --chunk 512 --repeats 3 --variants 1,replicated,ring

Per engine and repeat it prefills one prompt of ``--input-len`` random token ids in chunks of
``--chunk`` tokens (greedy, ``--output-len`` new tokens, EOS ignored) after a short warm-up
request, and reads every rank's ``Worker.step_stats`` before and after: tokens the rank ran
through the model (``dense_tokens``), seconds inside steps, inside the model's forward,
inside attention (the ring hops and all-gathers included) and inside CP collectives. Per
rank it prints the dense tokens, the dense FLOPs they cost (``2 x`` the non-embedding linear
weights per token) and the dense seconds (forward seconds minus attention seconds:
embedding, projections, MLP, norms), and the prompt's wall time. Variants: ``1`` = one process with one thread (what
each CP=2 rank gets on 2 cores), ``replicated`` and ``ring`` = CP=2 (two worker processes,
gloo, one thread each). Prints one JSON line per run and a summary with medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from tp_cpu import alternate, rank_stats

from kvflow import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--input-len", type=int, default=1536)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--output-len", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="1,replicated,ring")
    return p.parse_args()


def dense_flops_per_token(hf_config) -> int:
    """2 x the linear weights of the decoder layers (q, k, v, o, gate, up, down) of a
    Llama-style config: the FLOPs one token costs in the dense layers (LM head excluded)."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q = hf_config.num_attention_heads * head_dim
    kv = hf_config.num_key_value_heads * head_dim
    return 2 * layers * (h * (2 * q + 2 * kv) + 3 * h * hf_config.intermediate_size)


def run_once(args: argparse.Namespace, variant: str, prompt: list[int]) -> dict:
    cp = 1 if variant == "1" else 2
    kwargs = {} if cp == 1 else {"context_parallel_prefill": variant}
    llm = LLM(model=args.model, dtype=args.dtype, context_parallel_size=cp, cpu_threads=1,
              kv_cache_memory="256MiB", max_num_batched_tokens=args.chunk,
              max_model_len=args.input_len + args.output_len + 16, enable_prefix_caching=False,
              **kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            logprobs=1)
    try:
        llm.generate([prompt[:32]], SamplingParams(max_tokens=2), use_tqdm=False)
        before = rank_stats(llm)
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        elapsed = time.perf_counter() - start
        after = rank_stats(llm)
        flops = dense_flops_per_token(llm.engine.core.hf_config)
    finally:
        llm.shutdown()
    row = {"variant": variant, "elapsed_s": round(elapsed, 3), "tokens": out.token_ids,
           "logprob0": round(out.logprobs[0][out.token_ids[0]].logprob, 5)}
    if after:
        deltas = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
        row["per_rank"] = [{
            "dense_tokens": d["dense_tokens"],
            "dense_gflop": round(d["dense_tokens"] * flops / 1e9, 2),
            "dense_s": round(d["forward_s"] - d["attention_s"], 3),
            "attention_s": round(d["attention_s"], 3), "cp_comm_s": round(d["cp_comm_s"], 3),
            "step_s": round(d["step_s"], 3)} for d in deltas]
    return row


def summarize(rows: dict[str, list[dict]], variants: list[str]) -> dict:
    """Medians per variant (rank 0 and the slower rank's dense seconds), ratios to the
    replicated CP=2 prefill, and whether every run produced the same tokens."""
    out = {"median_elapsed_s": {v: statistics.median(r["elapsed_s"] for r in rs)
                                for v, rs in rows.items()}}
    cp_variants = [v for v in variants if v != "1"]
    out["median_max_rank_dense_s"] = {
        v: statistics.median(max(p["dense_s"] for p in r["per_rank"]) for r in rows[v])
        for v in cp_variants}
    out["dense_tokens_per_rank"] = {v: [p["dense_tokens"] for p in rows[v][0]["per_rank"]]
                                    for v in cp_variants}
    if "replicated" in rows:
        base = out["median_max_rank_dense_s"]["replicated"]
        out["dense_s_ratio_vs_replicated"] = {
            v: round(x / base, 3) for v, x in out["median_max_rank_dense_s"].items()}
        wall = out["median_elapsed_s"]["replicated"]
        out["wall_ratio_vs_replicated"] = {v: round(x / wall, 3)
                                           for v, x in out["median_elapsed_s"].items()}
    out["same_tokens"] = len({str(r["tokens"]) for rs in rows.values() for r in rs}) == 1
    out["max_logprob0_diff"] = max(r["logprob0"] for rs in rows.values() for r in rs) - \
        min(r["logprob0"] for rs in rows.values() for r in rs)
    return out


def main() -> None:
    args = parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(args.input_len)]
    variants = args.variants.split(",")
    rows = alternate(args, variants, lambda variant: run_once(args, variant, prompt))
    print(json.dumps({"loadavg_end": os.getloadavg(), **summarize(rows, variants)}))


if __name__ == "__main__":
    main()
