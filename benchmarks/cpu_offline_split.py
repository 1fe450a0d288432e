"""CPU-W1 split into its prefill and its decode (kvflow only): the 64 x 128 prompts of
benchmarks/offline_engine.py generated to one token (the prefill, with the first token), then
to 64 tokens (prefill and 63 decode steps of 64 rows); the difference is the decode's share.

    .venv/bin/python benchmarks/cpu_offline_split.py out/smollm2-hf float32 ['{"enforce_eager": true}']

The optional JSON object holds kvflow ``LLM`` options (env vars such as KVFLOW_CPU_GEMM apply
as usual). One process, one warm-up, each batch timed once: run it several times, alternating
variants, and compare medians (docs/benchmarks.md, session 13).
"""

from __future__ import annotations

import json
import sys
import time

from offline_engine import NUM_PROMPTS, OUTPUT_LEN, cpu_w1_token_ids, load_engine


def main() -> None:
    model_dir, dtype = sys.argv[1], sys.argv[2]
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    llm, sampling_params, _ = load_engine("kvflow", model_dir, dtype, **options)
    prompts = cpu_w1_token_ids(llm.get_tokenizer().vocab_size)

    def run(max_tokens: int) -> float:
        params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(2)  # warm-up: every prefill and decode batch size once
    prefill, full = run(1), run(OUTPUT_LEN)
    print(f"{options or 'defaults'}: prefill {prefill:.2f} s, whole {full:.2f} s "
          f"({NUM_PROMPTS * OUTPUT_LEN / full:.1f} out tok/s), decode {full - prefill:.2f} s "
          f"({1e3 * (full - prefill) / (OUTPUT_LEN - 1):.0f} ms a step)")


if __name__ == "__main__":
    main()
