"""Record an SLA engine's measured steps (issue 18): the step-time model's inputs, to replay.

Runs SmolLM2 in-process (``LLMEngine``, ``--target-tpot-ms 80 --target-ttft-ms 2000``) on a
synthetic-chat workload with Poisson arrivals on the real clock, the way a server's engine
loop sees it (it idles between arrivals when nothing runs), and writes every step the
step-time model observed as one JSON line: ``{"p", "d", "c", "s", "r"}`` (prefill tokens,
decode requests, context tokens, measured seconds, and per scheduled request [tokens computed,
tokens cached before]). Then, on the idle engine, it sends lone prompts
of about ``--lone-tokens`` tokens (other text, no prefix-cache hit) one at a time and records
their forecast TTFT (``SLOPlanner.ttft_outlook`` just before they are queued) and their
measured TTFT as ``{"lone": tokens, "forecast", "ttft"}`` lines.

``tests/core/test_step_time_replay.py`` replays such a recording
(``tests/data/smollm2_cpu_steps.jsonl``) through ``StepTimeModel``.

Usage::

    .venv/bin/python benchmarks/slo_record_steps.py --out tests/data/smollm2_cpu_steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvflow.bench.datasets import synthetic_chat_requests
from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.sampling_params import SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, req/s")
    p.add_argument("--lone", type=int, default=3, help="lone prompts sent at the end")
    p.add_argument("--lone-tokens", type=int, default=550)
    p.add_argument("--out", required=True)
    return p.parse_args()


def chat_prompt(engine: LLMEngine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def record_observations(engine: LLMEngine, lines: list[dict]) -> None:
    """Wrap the planner's ``note_step`` and its model's ``observe`` so each measured step is
    also kept, with its composition (``"r"``: [tokens computed, tokens cached before] per
    scheduled request)."""
    planner = engine.core.scheduler.planner
    model, note_step, observe = planner.model, planner.note_step, planner.model.observe
    composition: list = []

    def noted(out, requests):
        composition[:] = [[n, requests[rid].num_computed_tokens - n]
                          for rid, n in out.num_scheduled_tokens.items() if rid in requests]
        note_step(out, requests)

    def observed(features, seconds, predicted=None):
        lines.append({"p": features.prefill_tokens, "d": features.decode_requests,
                      "c": features.context_tokens, "s": round(seconds, 6),
                      "r": list(composition)})
        observe(features, seconds, predicted)

    planner.note_step, model.observe = noted, observed


def run_workload(engine: LLMEngine, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    reqs = synthetic_chat_requests(args.num_prompts, seed=0)
    arrivals = np.cumsum(rng.exponential(1 / args.rate, len(reqs)))
    start, i = time.monotonic(), 0
    while i < len(reqs) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while i < len(reqs) and arrivals[i] <= now:
            params = SamplingParams(max_tokens=reqs[i].output_len, ignore_eos=True)
            engine.add_request(chat_prompt(engine, reqs[i].messages), params)
            i += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif i < len(reqs):
            time.sleep(max(0.0, arrivals[i] - now))


def lone_prompt(engine: LLMEngine, n: int, k: int) -> list[int]:
    words = [f"{w}{k}" for w in ("lone", "prompt", "words", "here")]
    ids = engine.tokenizer.encode(" ".join(words[j % 4] for j in range(n)))
    return list(ids[:n])


def run_lone(engine: LLMEngine, args: argparse.Namespace, lines: list[dict]) -> None:
    sched = engine.core.scheduler
    for k in range(args.lone):
        time.sleep(1.0)
        ids = lone_prompt(engine, args.lone_tokens, k)
        rid = engine.add_request(ids, SamplingParams(max_tokens=2, ignore_eos=True))
        request = next(r for r in sched.waiting if r.request_id.startswith(rid))
        t0 = time.monotonic()
        forecast = sched.planner.ttft_outlook(request, len(ids), [], [], sched.clock())
        ttft = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs and out.outputs[0].token_ids:
                    ttft = time.monotonic() - t0
        lines.append({"lone": len(ids), "forecast": forecast, "ttft": round(ttft, 6)})
        print(lines[-1], flush=True)


def main() -> None:
    args = parse_args()
    config = EngineConfig.from_kwargs(model=args.model, dtype="float32",
                                      kv_cache_memory="256MiB", target_tpot_ms=80.0,
                                      target_ttft_ms=2000.0)
    engine = LLMEngine(config)
    lines: list[dict] = []
    record_observations(engine, lines)
    try:
        run_workload(engine, args)
        run_lone(engine, args, lines)
    finally:
        engine.shutdown()
    with open(args.out, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    model = engine.core.scheduler.planner.model
    print(f"{len(lines)} lines; coef {model.coef}, bias {model.bias:.3f}, "
          f"rel error {model.mean_rel_error:.3f}")


if __name__ == "__main__":
    main()
