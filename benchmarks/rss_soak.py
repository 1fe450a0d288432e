"""Resident memory (RSS) across many small requests that end every way: does per-request state
leak? Not a unit test (tests/test_request_state_leaks.py checks the containers themselves);
this measures what a leak the walk cannot see would cost (a C extension's, a tokenizer's).

Requests go in rounds of 10 of ``--prompt-len`` random token ids: 4 greedy ones read to
their end, 2 sampled with n=2 and logprobs, one constrained by a regex, one ended by a stop
string, one aborted after its first step (``--api async``: its reader leaves instead, the
generator closed) and one refused up front as too long. After ``--warmup`` requests the RSS
(``/proc/PID/status`` VmRSS, after ``gc.collect()``) is sampled every ``--every`` requests: of
this process and, with ``--api async``, of its engine-core process too. The report is the
least-squares slope of RSS over requests, in MiB per 1000 requests, and the first and last
sample, as one JSON line (``samples``: every sample, [requests after the warm-up, this
process's MiB, the core's MiB or null]).

Usage (docs/benchmarks.md):
    .venv/bin/python benchmarks/rss_soak.py                       # offline LLMEngine, 2000
    .venv/bin/python benchmarks/rss_soak.py --api async           # AsyncLLM + its core
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time

from kvflow import SamplingParams
from kvflow.config import EngineConfig
from kvflow.structured import StructuredOutputsParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--api", choices=["offline", "async"], default="offline")
    p.add_argument("--requests", type=int, default=2000, help="measured, after the warm-up")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--every", type=int, default=100, help="requests between RSS samples")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def rss_mib(pid: int) -> float:
    """VmRSS of process ``pid`` in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope_per_1000(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``, times 1000 (MiB per 1000 requests)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def round_params(args: argparse.Namespace) -> list[tuple[str, SamplingParams]]:
    """The kinds of one round of 10 requests: (how it ends, its parameters)."""
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    return [("finish", greedy)] * 4 + [
        ("finish", SamplingParams(temperature=1.0, n=2, logprobs=2, max_tokens=args.max_tokens,
                                  seed=1))] * 2 + [
        ("finish", SamplingParams(max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))),
        ("finish", SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  stop=["a", "e", "o", " "])),
        ("abort", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)),
        ("too_long", greedy)]


def offline_round(engine, prompts, kinds, too_long) -> None:
    """One round through an LLMEngine: add, step once, abort the one to abort, step to the
    end."""
    aborted = []
    for prompt, (how, params) in zip(prompts, kinds):
        if how == "too_long":
            try:
                engine.add_request({"prompt_token_ids": too_long}, params)
            except ValueError:
                continue
            raise RuntimeError("a prompt over max_model_len was accepted")
        rid = engine.add_request({"prompt_token_ids": prompt}, params)
        if how == "abort":
            aborted.append(rid)
    engine.step()
    for rid in aborted:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


async def async_round(engine, prompts, kinds, too_long, base: int) -> None:
    """One round through an AsyncLLM: every request read concurrently; the one to abort is
    left after its first output (its generator closed, as a client that disconnects)."""
    async def one(i, prompt, how, params):
        if how == "too_long":
            try:
                engine.add_request(f"r{base + i}", None, too_long, params)
            except ValueError:
                return
            raise RuntimeError("a prompt over max_model_len was accepted")
        gen = engine.generate({"prompt_token_ids": prompt}, params, f"r{base + i}")
        async for _ in gen:
            if how == "abort":
                await gen.aclose()
                return

    await asyncio.gather(*(one(i, p, how, params)
                           for i, (p, (how, params)) in enumerate(zip(prompts, kinds))))


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    config = EngineConfig.from_kwargs(model=args.model, max_model_len=args.max_model_len)
    kinds = round_params(args)
    samples: list[tuple[int, float, float | None]] = []
    total = args.warmup + args.requests
    start = time.perf_counter()

    def prompts_of_round(vocab: int) -> tuple[list[list[int]], list[int]]:
        prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_len)] for _ in kinds]
        return prompts, [rng.randrange(2, vocab) for _ in range(args.max_model_len + 1)]

    def sample(done: int, core_pid: int | None) -> None:
        if done >= args.warmup and (done - args.warmup) % args.every == 0:
            gc.collect()
            samples.append((done - args.warmup, rss_mib(os.getpid()),
                            None if core_pid is None else rss_mib(core_pid)))

    if args.api == "offline":
        from kvflow.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        vocab = engine.processor.vocab_size
        for done in range(0, total, len(kinds)):
            sample(done, None)
            prompts, too_long = prompts_of_round(vocab)
            offline_round(engine, prompts, kinds, too_long)
        sample(total, None)
    else:
        from kvflow.engine.async_llm import AsyncLLM

        engine = AsyncLLM(config)

        async def run() -> None:
            await engine.start()
            try:
                vocab = engine.processor.vocab_size
                for done in range(0, total, len(kinds)):
                    sample(done, engine.core_pid)
                    prompts, too_long = prompts_of_round(vocab)
                    await async_round(engine, prompts, kinds, too_long, done)
                sample(total, engine.core_pid)
            finally:
                await engine.shutdown()

        try:
            asyncio.run(run())
        finally:
            engine.close()
    report(args, samples, time.perf_counter() - start)


def report(args: argparse.Namespace, samples: list, seconds: float) -> None:
    xs = [s[0] for s in samples]
    out = {"api": args.api, "model": args.model, "requests": args.requests,
           "warmup": args.warmup, "seconds": round(seconds, 1),
           "front_rss_mib_first_last": [round(samples[0][1], 1), round(samples[-1][1], 1)],
           "front_mib_per_1000": round(slope_per_1000(xs, [s[1] for s in samples]), 2)}
    if samples[0][2] is not None:
        out["core_rss_mib_first_last"] = [round(samples[0][2], 1), round(samples[-1][2], 1)]
        out["core_mib_per_1000"] = round(slope_per_1000(xs, [s[2] for s in samples]), 2)
    out["samples"] = [[n, round(front, 1), None if core is None else round(core, 1)]
                      for n, front, core in samples]  # requests after warm-up, MiB, MiB
    print(json.dumps(out))


if __name__ == "__main__":
    main()
