"""``kvflow bench latency``: offline TTFT and TPOT per batch size with ``kvflow.LLM``.

Per batch size B: B prompts of ``input_len`` random token ids, greedy, EOS ignored, prefix cache
reset before every timed call. TTFT = wall time of a ``max_tokens=1`` call (the whole batch's
prefill plus one sample); TPOT = (t(output_len tokens) - t(1 token)) / (output_len - 1), the
method of the peer figures in docs/benchmarks.md. Each figure is the median of ``--num-iters``
repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvflow.bench.checks import (
    ensure_parent_dir,
    parse_positive_ints,
    require_fits,
    require_one_engine,
    require_positive,
)
from kvflow.bench.throughput import random_prompts
from kvflow.config import EngineConfig
from kvflow.lora.path_flag import add_lora_path_arg, lora_request_from_flags


def _timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int,
                    lora_request: Any = None) -> float:
    """Seconds for one ``generate`` call (prefix cache reset first; through
    ``lora_request``'s adapter when given)."""
    from kvflow.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return time.perf_counter() - start


def measure_batch(llm: Any, prompts: list[list[int]], output_len: int,
                  num_iters: int, lora_request: Any = None) -> dict[str, float]:
    """Median TTFT, TPOT and end-to-end seconds and output tokens/s of one batch (through
    ``lora_request``'s adapter when given)."""
    ttfts, e2es = [], []
    for _ in range(num_iters):
        ttfts.append(_timed_generate(llm, prompts, 1, lora_request))
        e2es.append(_timed_generate(llm, prompts, output_len, lora_request))
    ttft, e2e = statistics.median(ttfts), statistics.median(e2es)
    tpot = (e2e - ttft) / (output_len - 1) if output_len > 1 else float("nan")
    return {"batch_size": len(prompts), "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
            "output_tok_per_s": len(prompts) * output_len / e2e}


def _cmd_latency(args: argparse.Namespace) -> int:
    from kvflow.offline.llm import LLM

    sizes = parse_positive_ints(args.batch_sizes, "--batch-sizes")
    require_positive(input_len=args.input_len, num_iters=args.num_iters)
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0 (it seeds the random prompts), got {args.seed}")
    if args.output_len < 2:
        raise ValueError(f"--output-len must be >= 2 (TPOT needs two tokens), got "
                         f"{args.output_len}")
    if max(sizes) > args.max_num_seqs:  # smaller batches in turn, labelled as this one
        raise ValueError(f"--batch-sizes {max(sizes)} exceeds --max-num-seqs "
                         f"{args.max_num_seqs}: the engine runs at most {args.max_num_seqs} "
                         f"requests at once, so it would not time a batch of {max(sizes)}; "
                         "raise --max-num-seqs or lower the batch size")
    ensure_parent_dir(args.output_json, "--output-json")
    require_one_engine(args.data_parallel_size, "latency")
    config = EngineConfig.from_cli_args(args)
    lora = lora_request_from_flags(args.lora_path, config.lora_config.enable_lora,
                                   "kvflow bench latency")
    llm = LLM.from_engine_config(config)
    require_fits(llm.engine.core.max_model_len, args.input_len, args.output_len)
    vocab = llm.engine.core.hf_config.vocab_size
    _timed_generate(llm, random_prompts(2, args.input_len, vocab, args.seed + 1), 4,
                    lora)  # warm-up
    batches = []
    print(f"{'batch':>6} {'TTFT ms':>10} {'TPOT ms':>10} {'e2e s':>8} {'out tok/s':>10}")
    for size in sizes:
        prompts = random_prompts(size, args.input_len, vocab, args.seed)
        b = measure_batch(llm, prompts, args.output_len, args.num_iters, lora)
        batches.append(b)
        print(f"{size:>6} {b['ttft_s'] * 1e3:>10.1f} {b['tpot_s'] * 1e3:>10.2f} "
              f"{b['e2e_s']:>8.2f} {b['output_tok_per_s']:>10.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "input_len": args.input_len,
                       "output_len": args.output_len, "batches": batches}, f, indent=1)
    return 0


def add_latency_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="offline TTFT/TPOT per batch size",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    p.add_argument("--num-iters", type=int, default=3, help="repetitions (median)")
    p.add_argument("--output-json", default=None, help="write the results here (JSON)")
    add_lora_path_arg(p, "every request")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=_cmd_latency)
