"""Offline throughput quiet and beside one busy-looping process, for
``benchmarks/cpu_contention.sh``. Runs in the engine's own virtualenv:

    python benchmarks/cpu_contention.py --engine kvflow|vllm MODEL_DIR DTYPE OUT.json

Workload (issue 23): 32 prompts x 128 token ids from numpy ``default_rng(0).integers(3,
min(vocab, 32000))`` -> 32 greedy tokens each, EOS ignored, prefix caching off. After a
two-prompt warm-up the batch runs once on the quiet machine, then once more while a second
process spins (``while True: pass``, started here and killed after). Throughput = generated
tokens / wall time of the batch; share = busy / quiet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from offline_engine import cpu_w1_token_ids, engine_parser, greedy_run, load_engine

NUM_PROMPTS, OUTPUT_LEN = 32, 32  # prompts of offline_engine.INPUT_LEN (128) tokens


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--adaptive", action="store_true",
                        help="kvflow: --cpu-adaptive-threads (opt-in; default: fixed count)")
    parser.add_argument("--bind", help="kvflow: --cpu-threads-bind (e.g. auto, none; "
                        "default: kvflow's default pinning)")
    args = parser.parse_args()
    llm, sampling_params, wrap = load_engine(
        args.engine, args.model_dir, args.dtype,
        **({"kv_cache_memory": "512MiB", "cpu_adaptive_threads": args.adaptive,
            "cpu_threads_bind": args.bind} if args.engine == "kvflow" else {}))
    import torch

    vocab = llm.get_tokenizer().vocab_size
    prompts = [wrap(row) for row in cpu_w1_token_ids(vocab, NUM_PROMPTS)]
    greedy_run(llm, sampling_params, prompts[:2], 4)  # warm-up

    runner = getattr(getattr(getattr(getattr(llm, "engine", None), "core", None), "executor",
                             None), "worker", None)
    adaptive = getattr(getattr(runner, "runner", None), "adaptive_threads", None)

    def governor_state() -> str:
        if adaptive is None:
            return "fixed threads"
        g = adaptive.governor
        return f"{g.switches} switches, {g.reduced_s:.1f} s below {g.max_threads} threads"

    def tokens_per_s() -> float:
        elapsed, produced = greedy_run(llm, sampling_params, prompts, OUTPUT_LEN)
        return produced / elapsed

    result = {"engine": args.engine, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "adaptive": args.engine == "kvflow" and args.adaptive,
              "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
              "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "quiet": tokens_per_s()}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        result["governor_quiet"] = governor_state()
        result["busy"] = tokens_per_s()
        result["governor_busy"] = governor_state()
    finally:
        busy.kill()
        busy.wait()
    result["share"] = result["busy"] / result["quiet"]
    print(f"{args.engine}: quiet {result['quiet']:.1f}, busy {result['busy']:.1f} out tok/s, "
          f"share {result['share']:.2f} ({result['governor_quiet']}; after busy: "
          f"{result['governor_busy']})")
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
