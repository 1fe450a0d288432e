"""One engine's offline figures on workload CPU-W1 (docs/benchmarks.md) with the same harness for
kvflow and vLLM CPU, for ``benchmarks/compare_offline.sh``. Runs in the engine's own
virtualenv:

    python benchmarks/offline_engine.py --engine kvflow|vllm MODEL_DIR DTYPE OUT.json

Throughput: 64 x 128 token ids from numpy ``default_rng(0).integers(3, min(vocab, 32000))``, 64
greedy tokens each, EOS ignored, prefix caching off; generated tokens / wall time of the whole
batch (prefill included), after a two-prompt warm-up. Batch 1 (PEERS.md's method): prompt 0
alone; decode ms/token = (t(65 tokens) - t(1 token)) / 64, each time the median of 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 128, 64


def load_engine(engine: str, model_dir: str, dtype: str, **kvflow_options):
    """(LLM, SamplingParams class, prompt wrapper) of ``engine`` (kvflow or vllm), prefix
    caching off; ``kvflow_options`` go to kvflow's LLM (default KV cache 1 GiB). kvflow is
    imported before torch so its OpenMP settings apply, as in any kvflow process. Shared with
    cpu_contention.py."""
    if engine == "kvflow":
        from kvflow import LLM, SamplingParams

        options = {"kv_cache_memory": "1GiB", **kvflow_options}
        return LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False, **options), \
            SamplingParams, (lambda ids: ids)
    try:
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        raise SystemExit(f"--engine vllm: vllm is not importable by {sys.executable} ({exc}); "
                         "run this script with the vLLM venv's python") from exc

    return LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False), SamplingParams, \
        (lambda ids: {"prompt_token_ids": ids})


def cpu_w1_token_ids(vocab: int, num_prompts: int = NUM_PROMPTS) -> list[list[int]]:
    """CPU-W1's prompts: num_prompts x INPUT_LEN token ids drawn by numpy ``default_rng(0)``
    from [3, min(vocab, 32000)) (fewer prompts are the first rows of the same draw)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(3, min(vocab, 32000), (num_prompts, INPUT_LEN)).tolist()


def greedy_run(llm, sampling_params, batch: list, max_tokens: int) -> tuple[float, int]:
    """Seconds of one ``llm.generate`` of ``batch`` (``max_tokens`` greedy tokens each, EOS
    ignored) and the tokens it produced; ``sampling_params`` is the engine's class. Shared with
    cpu_step_graphs.py, cpu_decode_floor.py and cpu_contention.py."""
    params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def engine_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a script on one engine: ``--engine kvflow|vllm MODEL_DIR DTYPE
    OUT.json`` (``doc``: the script's docstring, its first line the description). Shared with
    cpu_contention.py."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--engine", choices=["kvflow", "vllm"], required=True)
    parser.add_argument("model_dir")
    parser.add_argument("dtype")
    parser.add_argument("out")
    return parser


def main() -> None:
    args = engine_parser(__doc__).parse_args()
    start = time.perf_counter()
    llm, sampling_params, wrap = load_engine(args.engine, args.model_dir, args.dtype)
    startup_s = time.perf_counter() - start
    prompts = [wrap(row) for row in cpu_w1_token_ids(llm.get_tokenizer().vocab_size)]

    def run(batch: list, max_tokens: int) -> tuple[float, int]:
        return greedy_run(llm, sampling_params, batch, max_tokens)

    run(prompts[:2], 4)  # warm-up
    elapsed, produced = run(prompts, OUTPUT_LEN)
    if produced != NUM_PROMPTS * OUTPUT_LEN:
        raise RuntimeError(f"{args.engine} produced {produced} tokens, expected "
                           f"{NUM_PROMPTS * OUTPUT_LEN}")
    ttft = statistics.median(run(prompts[:1], 1)[0] for _ in range(3))
    full = statistics.median(run(prompts[:1], OUTPUT_LEN + 1)[0] for _ in range(3))
    result = {"engine": args.engine, "dtype": args.dtype, "startup_s": startup_s,
              "elapsed_s": elapsed, "output_tokens_per_s": produced / elapsed,
              "b1_ttft_ms": 1e3 * ttft, "b1_decode_ms_per_token": 1e3 * (full - ttft) / OUTPUT_LEN}
    print(f"{args.engine} {args.dtype}: {result['output_tokens_per_s']:.1f} out tok/s, batch 1 "
          f"TTFT {result['b1_ttft_ms']:.1f} ms, decode {result['b1_decode_ms_per_token']:.2f} "
          f"ms/token, start-up {startup_s:.1f} s")
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
