"""Parallel runs against the one-process engine on tiny random models, at a load the test
suite does not reach: 12 concurrent greedy requests (requests finishing in the same step, rows
reused), several layouts and quantizations. Too slow for the suite (two worker processes per
case, about 20-40 s each on 2 busy cores); run it after touching the executor, the workers,
the input batch or a quantization method.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/parallel_consistency.py [CASE ...]

Per case it prints the largest |logprob difference| of the sampled tokens and the first token
where the runs part; a case fails (exit status 1) when they part where the reference's top-2
logprobs are more than 1e-3 apart, or differ by more than 1e-4 before that. FP8 at TP=2 is
not a case: its row-parallel activations are scaled per rank (README, Quantization).
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("KVFLOW_CPU_ADAPTIVE_THREADS", "0")

from tiny_cases import build_model, parse_cases

from kvflow import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 2, 91, 7], [40, 41, 42] * 7, [9, 250, 31, 77], list(range(60, 100))] * 3
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
# name: (tiny model, engine keywords of the parallel run; the reference drops the parallel ones)
CASES = {
    "tp2": ("llama", {"tensor_parallel_size": 2}),
    "pp2": ("gemma3", {"pipeline_parallel_size": 2}),
    "cp2": ("llama", {"context_parallel_size": 2}),
    "tp2-int8": ("llama", {"tensor_parallel_size": 2, "quantization": "int8"}),
    "tp2-int8-moe": ("mixtral", {"tensor_parallel_size": 2, "quantization": "int8"}),
    "tp2-ep": ("qwen2_moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    "tp2-kv-int8": ("llama_mqa", {"tensor_parallel_size": 2, "kv_cache_dtype": "int8"}),
}
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                 "enable_expert_parallel")


def greedy(path: str, **kwargs) -> list[list[tuple[int, dict]]]:
    """Per prompt: [(token id, {token id: logprob})] of a greedy fp32 run."""
    llm = LLM(model=path, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32,
              **kwargs)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    return [[(t, {k: v.logprob for k, v in lp.items()})
             for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]


def compare(ref: list, got: list) -> tuple[float, str | None]:
    """(largest |logprob difference| before the runs part, failure or None)."""
    worst = 0.0
    for p, (r, g) in enumerate(zip(ref, got)):
        for i, ((rt, rlp), (gt, glp)) in enumerate(zip(r, g)):
            if rt != gt:
                top = sorted(rlp.values(), reverse=True)
                if len(top) < 2 or top[0] - top[1] > 1e-3:
                    return worst, f"prompt {p} token {i}: {gt} != {rt}"
                break
            worst = max(worst, abs(rlp[rt] - glp[gt]))
    return worst, (f"logprobs differ by {worst:.2e}" if worst > 1e-4 else None)


def main() -> int:
    selected = parse_cases(__doc__, CASES)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="kvflow-parallel-") as folder:
        for case in selected:
            model, kwargs = CASES[case]
            path = build_model(folder, model)
            ref = greedy(path, **{k: v for k, v in kwargs.items() if k not in PARALLEL_KEYS})
            worst, failure = compare(ref, greedy(path, **kwargs))
            failed += failure is not None
            print(f"{case:14s} max |dlogprob| {worst:.2e}  {failure or 'ok'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
