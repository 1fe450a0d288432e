"""CPU-W1 split into its prefill and its decode, for kvflow or vLLM CPU: the 64 x 128 prompts
of benchmarks/offline_engine.py generated to one token (the prefill, with the first token),
then to 64 tokens (prefill and 63 decode steps of 64 rows); the difference is the decode's
share. Each is timed ``--repeats`` times after a warm-up of the whole workload (so every
batch size has run once: first-use costs such as oneDNN primitive creation are not counted),
and the medians are printed.

    .venv/bin/python benchmarks/cpu_offline_split.py out/smollm2-hf float32 ['{"enforce_eager": true}']
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
        /work/vllm-venv/bin/python benchmarks/cpu_offline_split.py --engine vllm out/smollm2-hf bfloat16

(vLLM's settings as compare_offline.sh sets them: without the first, vLLM CPU keeps one of the
two cores for its front end and computes on one, about half as fast.)

The optional JSON object holds kvflow ``LLM`` options (env vars such as KVFLOW_CPU_GEMM apply
as usual). Run it several times, alternating variants or engines, and compare medians
(docs/benchmarks.md, sessions 13 and 27).
"""

from __future__ import annotations

import argparse
import json
import statistics

from offline_engine import NUM_PROMPTS, OUTPUT_LEN, cpu_w1_token_ids, greedy_run, load_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["kvflow", "vllm"], default="kvflow")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("model_dir")
    parser.add_argument("dtype")
    parser.add_argument("options", nargs="?", default="{}",
                        help="kvflow LLM options as a JSON object")
    args = parser.parse_args()
    options = json.loads(args.options)
    if options and args.engine != "kvflow":
        parser.error("options are kvflow LLM options; --engine vllm takes none")
    llm, sampling_params, wrap = load_engine(args.engine, args.model_dir, args.dtype, **options)
    prompts = [wrap(row) for row in cpu_w1_token_ids(llm.get_tokenizer().vocab_size)]

    def run(max_tokens: int) -> float:
        return greedy_run(llm, sampling_params, prompts, max_tokens)[0]

    run(OUTPUT_LEN)  # warm-up: every prefill and decode batch size once
    prefills, fulls = [], []
    for _ in range(args.repeats):  # alternating, so drift hits both alike
        prefills.append(run(1))
        fulls.append(run(OUTPUT_LEN))
    prefill, full = statistics.median(prefills), statistics.median(fulls)
    print(f"{args.engine} {args.dtype} {options or 'defaults'}: prefill {prefill:.2f} s "
          f"(runs {', '.join(f'{t:.2f}' for t in prefills)}), whole {full:.2f} s "
          f"(runs {', '.join(f'{t:.2f}' for t in fulls)}; "
          f"{NUM_PROMPTS * OUTPUT_LEN / full:.1f} out tok/s), decode {full - prefill:.2f} s "
          f"({1e3 * (full - prefill) / (OUTPUT_LEN - 1):.0f} ms a step)")


if __name__ == "__main__":
    main()
