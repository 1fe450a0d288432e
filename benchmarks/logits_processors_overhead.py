"""Cost of one custom logits processor: the same offline greedy batch with the processor off
and on, alternating rounds on one engine (machines are noisy; compare medians).

The engine starts with ``logits_processors=[BanLastToken]``, a trivial batched processor
that sets the vocabulary's last id to -inf in the rows of requests whose ``extra_args``
hold ``"ban_last": True`` (every request here); the greedy text never holds that id, so
both modes generate the same tokens (checked). An "off" round sets the runner's
``logits_procs`` to None, which is what an engine started without processors runs (the
sampler checks one ``None``); an "on" round gives it a fresh ``RunnerLogitsProcessors``
(the per-step work: extending each request's generated-token list, the batch update, the
processor's ``update_state`` and ``apply``). One engine, so start-up choices such as timed
kernels cannot differ between the modes.

    flock /work/notes/bench.lock .venv/bin/python benchmarks/logits_processors_overhead.py \\
        --model out/smollm2-hf --rounds 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvflow import LLM, SamplingParams
from kvflow.batch_update import apply_batch_update
from kvflow.logits_process import LogitsProcessor
from kvflow.worker.logits_procs import RunnerLogitsProcessors

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "pages",
         "of", "keys", "and", "values", "move", "through", "blocks", "of", "tokens"]


class BanLastToken(LogitsProcessor):
    """-inf at the last vocabulary id in the rows of requests with ``ban_last``."""

    calls = 0  # apply calls, all instances (the "on" rounds must make some, "off" none)

    def __init__(self, config, device, is_pin_memory) -> None:
        self.rows: dict[int, bool] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        apply_batch_update(self.rows, batch_update,
                           lambda added: (added[1].extra_args or {}).get("ban_last"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        BanLastToken.calls += 1
        if self.rows:
            logits[list(self.rows), -1] = float("-inf")
        return logits


def prompts_for(round_index: int, num_prompts: int, words: int) -> list[str]:
    rng = random.Random(round_index)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(num_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="out/smollm2-hf")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per mode")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype="float32", device="cpu", max_num_seqs=args.batch,
              logits_processors=[BanLastToken])
    runner = llm.engine.core.executor.runner
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            extra_args={"ban_last": True})
    llm.generate(prompts_for(-1, args.batch, args.prompt_words), params, use_tqdm=False)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    same = True
    for r in range(args.rounds):
        prompts = prompts_for(r, args.batch, args.prompt_words)
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        outs = {}
        for mode in order:
            runner.logits_procs = None if mode == "off" else RunnerLogitsProcessors(
                [BanLastToken], runner.config, runner.device)
            calls = BanLastToken.calls
            began = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - began
            tokens = sum(len(o.outputs[0].token_ids) for o in res)
            rates[mode].append(tokens / seconds)
            outs[mode] = [o.outputs[0].token_ids for o in res]
            applied = BanLastToken.calls - calls
            assert (applied > 0) == (mode == "on"), (mode, applied)
        same &= outs["off"] == outs["on"]
        print(f"round {r}: off {rates['off'][-1]:.1f} tok/s, on {rates['on'][-1]:.1f} tok/s",
              flush=True)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"batch {args.batch} x {args.max_tokens} tokens, {args.rounds} rounds per mode: "
          f"median off {off:.1f} tok/s, on {on:.1f} tok/s, on/off {on / off:.3f}; "
          f"same tokens: {same}")


if __name__ == "__main__":
    main()
