"""Beam search's cost above the engine: ``LLM.beam_search`` against ``LLM.generate`` producing
the same number of tokens per sequence, in one process, alternating, median of ``--repeats``.

Usage:
    .venv/bin/python benchmarks/beam_search_cost.py [--model out/smollm2-hf] [--tokens 32]

Prints one line per width: beam_search seconds, generate seconds (greedy for width 1,
``n=width`` sampled otherwise, ``ignore_eos`` both), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvflow import LLM, BeamSearchParams, SamplingParams

PROMPT = "The capital of France is"


def _seconds(call, *args, **kwargs) -> float:
    began = time.perf_counter()
    call(*args, **kwargs)
    return time.perf_counter() - began


def main() -> None:
    """Parse the arguments, time both engines' calls alternately, print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="out/smollm2-hf")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype="float32", device="cpu", block_size=16)
    for width in args.widths:
        beam = BeamSearchParams(beam_width=width, max_tokens=args.tokens, ignore_eos=True)
        sampled = SamplingParams(n=width, max_tokens=args.tokens, ignore_eos=True,
                                 temperature=0.0 if width == 1 else 1.0, seed=0)
        llm.beam_search([PROMPT], beam)  # warm-up (also fills the prefix cache for both)
        beam_s, gen_s = [], []
        for _ in range(args.repeats):
            beam_s.append(_seconds(llm.beam_search, [PROMPT], beam))
            gen_s.append(_seconds(llm.generate, [PROMPT], sampled, use_tqdm=False))
        b, g = statistics.median(beam_s), statistics.median(gen_s)
        print(f"width {width}: beam_search {b:.2f} s, generate(n={width}) {g:.2f} s, "
              f"ratio {b / g:.2f}x ({args.tokens} tokens, median of {args.repeats})")


if __name__ == "__main__":
    main()
