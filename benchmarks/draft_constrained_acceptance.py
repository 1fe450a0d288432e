"""Acceptance of a draft model's drafts for constrained requests: every draft within its grammar
row (kvflow's default) against the first draft only (how kvflow drafted before 2026-12-05).

One engine with ``{"method": "draft_model"}`` (default: the model drafting for itself, so a
draft the grammar allows is the target's own choice) runs each workload greedily twice: once as
it is, once with the draft's rows for drafts 2..k withheld (the executor's ``launch_forward``
is wrapped to pass no ``draft_grammar``: drafts 2..k are then proposed without the grammar, as
before). Both runs are exact (greedy text equal; the script exits 1 otherwise), so only the
drafts accepted and the decode time differ. Prints, per workload and mode, draft tokens,
accepted tokens, the acceptance rate, mean accepted tokens per verification step and decode
wall time, then the ratio every/first of the acceptance rates::

    .venv/bin/python benchmarks/draft_constrained_acceptance.py --model out/smollm2-hf

Workloads (raw prompts, chat template applied): a JSON schema (a list of people), a regex (ISO
dates), a choice, and a tool call (``tool_choice="required"``'s grammar over two tools).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams

PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "maxItems": 3, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                     "age": {"type": "integer"},
                                     "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "age", "city"]}}}, "required": ["people"]}
DATES = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])(, (19|20)[0-9]{2}-" \
        r"(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])){0,5}"


def tool_call_constraint() -> StructuredOutputsParams:
    """The grammar of ``tool_choice="required"`` over a weather and a time tool."""
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.structured_requests import tool_constraint

    def tool(name: str, prop: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {prop: {"type": "string"}}, "required": [prop]}}}

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                tools=[tool("get_weather", "city"), tool("get_time", "zone")],
                                tool_choice="required", parallel_tool_calls=False)
    return tool_constraint(req, "required")


WORKLOADS = {
    "json": (["List three people you know of with their age and city, as JSON.",
              "Give me a JSON object with people: name, age and city of two scientists."],
             lambda: StructuredOutputsParams(json=PEOPLE)),
    "regex": (["Write some dates of famous events in ISO format, separated by commas.",
               "When were the moon landings? Dates only, YYYY-MM-DD."],
              lambda: StructuredOutputsParams(regex=DATES)),
    "choice": (["Is the sky blue? Answer in a sentence.",
                "Which is larger, the sun or the moon?"],
               lambda: StructuredOutputsParams(choice=[
                   "Yes, the sky is blue on a clear day because of Rayleigh scattering.",
                   "The sun is much larger than the moon, about four hundred times wider.",
                   "No."])),
    "tool_call": (["What is the weather in Paris?", "What time is it in Tokyo?"],
                  tool_call_constraint),
}


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    """One greedy generate: texts, draft / accepted tokens, verification steps, seconds."""
    messages = [[{"role": "user", "content": p}] for p in prompts]
    started = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {"texts": [o.outputs[0].text for o in outs],
            "drafted": sum(o.metrics.num_draft_tokens for o in outs),
            "accepted": sum(o.metrics.num_accepted_tokens for o in outs),
            "steps": sum(o.metrics.num_drafts for o in outs),
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds}


def first_draft_only(llm: LLM):
    """Wrap the executor's launch_forward to withhold the later drafts' grammar rows; returns
    the undo."""
    executor = llm.engine.core.executor
    real = executor.launch_forward
    executor.launch_forward = lambda sched, first=None, draft_grammar=None: real(sched, first)
    return lambda: setattr(executor, "launch_forward", real)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="out/smollm2-hf")
    ap.add_argument("--draft", default=None, help="default: the model itself")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory="512MiB",
              speculative_config={"method": "draft_model", "model": args.draft or args.model,
                                  "num_speculative_tokens": args.num_speculative_tokens,
                                  "adaptive": False})
    ok, rows = True, []
    for name in args.workloads.split(","):
        prompts, constraint = WORKLOADS[name]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                structured_outputs=constraint())
        run(llm, prompts[:1], params)  # warm-up (grammar compile, first passes)
        every = run(llm, prompts, params)
        undo = first_draft_only(llm)
        try:
            first = run(llm, prompts, params)
        finally:
            undo()
        if every["texts"] != first["texts"]:
            ok = False
            print(f"{name}: the greedy texts differ between the modes", file=sys.stderr)
        rows.append((name, first, every))
    print(f"{'workload':10} {'mode':6} {'drafted':>8} {'accepted':>8} {'rate':>6} "
          f"{'acc/step':>8} {'tokens':>6} {'seconds':>8}")
    for name, first, every in rows:
        for mode, r in (("first", first), ("every", every)):
            rate = r["accepted"] / max(r["drafted"], 1)
            print(f"{name:10} {mode:6} {r['drafted']:8d} {r['accepted']:8d} {rate:6.2f} "
                  f"{r['accepted'] / max(r['steps'], 1):8.2f} {r['tokens']:6d} "
                  f"{r['seconds']:8.2f}")
        rate_first = first["accepted"] / max(first["drafted"], 1)
        rate_every = every["accepted"] / max(every["drafted"], 1)
        print(f"{name:10} ratio every/first: acceptance rate "
              f"{rate_every / max(rate_first, 1e-9):.2f}x, decode time "
              f"{first['seconds'] / every['seconds']:.2f}x faster")
    print(json.dumps({"ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
