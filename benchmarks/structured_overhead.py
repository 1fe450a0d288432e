"""Per-step overhead of structured decoding: a batch of constrained requests vs the same batch
unconstrained, in one process, alternating rounds (machines are noisy; compare medians).

Every request decodes exactly ``--output-len`` tokens in both modes: unconstrained rows ignore
EOS; constrained rows follow a JSON schema whose array needs more items than fit, so they end
at max_tokens too. Decode-step times are each ``LLMEngine.step`` after the prefill step.

    .venv/bin/python benchmarks/structured_overhead.py --batch 32 --output-len 32 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import kvflow.layers.sampler as sampler_module
from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams
from kvflow.structured.manager import RequestStructuredOutput

# Seconds spent in the structured-output work itself, by part (robust to machine noise: the
# whole-step comparison is only meaningful on a quiet machine).
PART_TIMES: dict[str, float] = defaultdict(float)


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PART_TIMES[name] += time.perf_counter() - start
    return wrapper


def instrument(llm: LLM) -> None:
    """Time the three structured-output parts: bitmask fill (engine core), bitmask apply
    (sampler), token accept (the scheduler's matcher advance)."""
    manager = llm.engine.core.structured_output
    manager.grammar_bitmask = _timed("fill", manager.grammar_bitmask)
    sampler_module.apply_token_bitmask_fast = _timed("apply",
                                                     sampler_module.apply_token_bitmask_fast)
    # the scheduler advances each constrained request's matcher by one token per call
    RequestStructuredOutput.accept_token = _timed("accept", RequestStructuredOutput.accept_token)

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string"},
                         "forecast": {"type": "array", "minItems": 500,
                                      "items": {"type": "object",
                                                "properties": {"day": {"type": "integer"},
                                                               "sky": {"enum": ["sunny",
                                                                                "cloudy",
                                                                                "rain"]}},
                                                "required": ["day", "sky"]}}},
          "required": ["city", "forecast"]}


def decode_step_times(llm: LLM, prompts: list[list[int]], params: SamplingParams
                      ) -> list[float]:
    """Seconds of every step after the first (prefill) one, until the batch finishes."""
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(model=args.model, num_kv_blocks=args.batch * 8 + 8, block_size=16,
              enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    text = "Give the weather forecast for Paris for the next days as JSON. " * 8
    prompt = tokenizer.encode(text)[:args.input_len]
    prompts = [prompt[:-1] + [prompt[-1] + i % 7] for i in range(args.batch)]
    free = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate(prompts[:1], constrained, use_tqdm=False)  # warm-up: grammar backend + compile
    instrument(llm)
    steps: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(args.rounds):
        steps["unconstrained"] += decode_step_times(llm, prompts, free)
        PART_TIMES.clear()
        steps["constrained"] += decode_step_times(llm, prompts, constrained)
    num_steps = len(steps["constrained"]) // args.rounds + 1  # last round, prefill included
    base = statistics.median(steps["unconstrained"])
    print(f"model {args.model}, batch {args.batch}, input {args.input_len}, "
          f"output {args.output_len}, rounds {args.rounds}, threads {torch.get_num_threads()}")
    for name, times in steps.items():
        med = statistics.median(times)
        print(f"{name:>14}: {len(times)} decode steps, median {med * 1e3:.1f} ms, mean "
              f"{statistics.fmean(times) * 1e3:.1f} ms, overhead {100 * (med / base - 1):+.1f}%")
    parts = {k: v / num_steps * 1e3 for k, v in PART_TIMES.items()}
    total = sum(parts.values())
    print(f"structured-output work per step (last round): {total:.2f} ms = "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
          + f"; {100 * total / (base * 1e3):.1f}% of the unconstrained median step")


if __name__ == "__main__":
    main()
