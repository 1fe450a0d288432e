"""What --deterministic costs on CPU: offline throughput with and without it, one process.

Two engines of the same model (default kernels, and ``deterministic=True``: kvflow's C GEMM
everywhere, token-by-token attention) generate the same batch of random-token prompts in turn,
``--rounds`` times in ABBA order (so a drift in machine load hits both alike); each run is
timed twice: the whole batch (prefill + decode), and prefill alone (``max_tokens=1``). The
script prints every run, the medians and the ratios deterministic / default, and whether the
greedy tokens of the two modes agree (they may not: the kernels sum in other orders, and a
near-tie can flip; neither mode is the wrong one).

    flock /work/notes/bench.lock .venv/bin/python benchmarks/deterministic_cpu.py \
        --dtype float32        # CPU-W1-like: 32 prompts x 128 tokens -> 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

MODES = ("default", "deterministic")


def timed(llm, prompts, params) -> tuple[float, list[list[int]]]:
    """(seconds, token ids per prompt) of one offline batch."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per engine (two are loaded)")
    args = p.parse_args()

    from kvflow import LLM, SamplingParams

    engines = {mode: LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                         enable_prefix_caching=False, deterministic=mode == "deterministic")
               for mode in MODES}
    vocab = engines["default"].engine.core.hf_config.vocab_size
    prompts = np.random.default_rng(0).integers(10, vocab - 10,
                                                (args.num_prompts, args.input_len)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    rates = {(m, kind): [] for m in MODES for kind in ("total", "prefill")}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            total_s, tokens[mode] = timed(engines[mode], prompts, params)
            prefill_s, _ = timed(engines[mode], prompts, prefill)
            rates[mode, "total"].append(args.num_prompts * args.output_len / total_s)
            rates[mode, "prefill"].append(args.num_prompts * args.input_len / prefill_s)
            print(f"round {r + 1} {mode}: {rates[mode, 'total'][-1]:.1f} output tok/s "
                  f"({total_s:.2f} s), prefill {rates[mode, 'prefill'][-1]:.0f} prompt tok/s "
                  f"({prefill_s:.2f} s)", flush=True)
    for kind, unit in (("total", "output tok/s"), ("prefill", "prompt tok/s")):
        base, det = (statistics.median(rates[m, kind]) for m in MODES)
        print(f"{kind}: default {base:.1f}, deterministic {det:.1f} {unit} (medians of "
              f"{args.rounds}): {det / base:.3f}x")
    same = sum(a == b for a, b in zip(tokens["default"], tokens["deterministic"]))
    print(f"greedy outputs equal in both modes: {same}/{args.num_prompts}")


if __name__ == "__main__":
    main()
