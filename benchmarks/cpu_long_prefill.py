"""Prefill of one long prompt on CPU: kvflow vs one transformers forward pass, same threads.

    .venv/bin/python benchmarks/cpu_long_prefill.py [--tokens 4096] [--dtype float32]
        [--rounds 3] [--model out/smollm2-hf]

kvflow runs ``LLM.generate`` on the prompt (random token ids, ``default_rng(0)``) with
``max_tokens=1`` and prefix caching off, so its time is the prefill (chunked by the engine's
token budget, 2,048 on CPU) plus one sampled token; transformers runs the decoder stack once
over the whole prompt and the LM head on the last position (what a prefill needs; its full
``forward`` would also multiply every position by the 49,152-row LM head). Both in this
process, one after the other, for ROUNDS rounds; prints each time, the medians and the ratio.
Record ``uptime`` and the CPU with the figures (docs/benchmarks.md).
"""

# ruff: noqa: I001  (kvflow is imported before torch on purpose)
from __future__ import annotations

import argparse
import statistics
import time

from kvflow import LLM, SamplingParams  # before torch: kvflow's OpenMP settings apply

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="out/smollm2-hf")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    # a KV cache of about 2 prompts (the default sizes it from free memory; on a shared
    # machine the fp32 run was OOM-killed)
    cfg = AutoConfig.from_pretrained(args.model)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * dtype.itemsize
    kv_bytes = 2 * (args.tokens + 16) * per_token
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=args.tokens + 16, kv_cache_memory=max(kv_bytes, 64 << 20))
    threads = torch.get_num_threads()
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    ids = np.random.default_rng(0).integers(3, 32000, args.tokens).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([ids[:32]], params, use_tqdm=False)  # warm-up
    x = torch.tensor([ids])

    def hf_prefill() -> None:
        with torch.inference_mode():
            hidden = hf.model(x).last_hidden_state
            hf.lm_head(hidden[:, -1])

    times: dict[str, list[float]] = {"kvflow": [], "transformers": []}
    for _ in range(args.rounds):
        start = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        times["kvflow"].append(time.perf_counter() - start)
        torch.set_num_threads(threads)
        start = time.perf_counter()
        hf_prefill()
        times["transformers"].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name}: {', '.join(f'{t:.2f}' for t in ts)} s (median {statistics.median(ts):.2f})")
    ratio = statistics.median(times["transformers"]) / statistics.median(times["kvflow"])
    print(f"{args.tokens}-token prompt, {args.dtype}, {threads} threads: transformers / kvflow "
          f"time = {ratio:.2f}x")


if __name__ == "__main__":
    main()
