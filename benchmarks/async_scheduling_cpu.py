"""Does --async-scheduling pay on CPU? Offline throughput with and without it, one process.

Two engines of the same model (``async_scheduling`` off and on) generate the same batch in
turn, ``--rounds`` times; the script prints each run's output tokens per second, the medians
and their ratio. On CPU the forward pass runs on the calling thread, so scheduling step N+1
before step N's tokens are folded in cannot overlap anything: this measures what the
reordering costs or saves there.

    .venv/bin/python benchmarks/async_scheduling_cpu.py --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per engine (two are loaded)")
    args = p.parse_args()

    from kvflow import LLM, SamplingParams

    engines = {mode: LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                         async_scheduling=mode == "async")
               for mode in ("sync", "async")}
    vocab = engines["sync"].engine.core.hf_config.vocab_size
    prompts = np.random.default_rng(0).integers(10, vocab - 10,
                                                (args.num_prompts, args.input_len)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    rates: dict[str, list[float]] = {mode: [] for mode in engines}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for mode, llm in engines.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            rates[mode].append(sum(len(t) for t in tokens[mode]) / elapsed)
            print(f"round {r + 1} {mode}: {rates[mode][-1]:.1f} output tok/s", flush=True)
    assert tokens["sync"] == tokens["async"], "async scheduling changed the tokens"
    sync, overlap = statistics.median(rates["sync"]), statistics.median(rates["async"])
    print(f"sync {sync:.1f} tok/s, async {overlap:.1f} tok/s (medians of {args.rounds}): "
          f"{overlap / sync:.3f}x; same tokens")


if __name__ == "__main__":
    main()
