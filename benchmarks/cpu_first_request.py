"""A fresh engine's first request, step by step: what the CPU step graphs did with each decode
step (``eager``: a batch size's first step; ``record``; ``replay``) and its wall ms, for the
first and a second identical request (8 greedy tokens of "The capital of France is", bf16).

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_first_request.py out/smollm2-hf

Session 42 found the engine's first recorded step taking ~0.5 s (TorchDispatchMode's first
call imported torch._dynamo): a late token of the first request on every engine.
"""

from __future__ import annotations

import sys
import time

from cpu_graph_step_kinds import time_graph_steps

from kvflow import LLM, SamplingParams


def main() -> None:
    steps = time_graph_steps()
    llm = LLM(sys.argv[1], dtype="bfloat16", kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0, max_tokens=8)
    for i in range(2):
        steps.clear()
        start = time.perf_counter()
        llm.generate(["The capital of France is"], params, use_tqdm=False)
        print(f"request {i}: {1e3 * (time.perf_counter() - start):.0f} ms;",
              ", ".join(f"{kind} {ms:.1f}" for kind, _, ms in steps))


if __name__ == "__main__":
    main()
