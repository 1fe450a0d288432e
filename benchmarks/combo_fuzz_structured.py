"""Differential fuzz of structured output (``SamplingParams.structured_outputs``) combined with
the offline engine's other features (``kvflow.LLM``).

Each case draws one engine configuration exactly as ``combo_fuzz.py`` does (prefix caching,
chunked prefill with budgets down to 1 token, small KV pools with recompute or swap preemption,
n-gram and draft-model speculation, multi-LoRA, the priority policy, async scheduling, CPU step
graphs, block sizes 1-16, int8 / fp8 KV) and 3-8 requests, most of them constrained by one of a
JSON schema, ``json_object``, a regex, a choice or an EBNF grammar, the others free. Requests
draw n (1-3), max_tokens (1-40: often cut mid-structure), ``ignore_eos`` (a grammar ends them
anyway), min_tokens (which may leave the grammar nothing: ``length``), stop strings and stop
token ids taken from the oracle's own output, an abort in flight, and arrive over the first
steps. Prompts carry the tokens of a valid output, so n-gram drafts (and the target drafting
for itself) propose tokens the grammar takes as well as ones it rejects: the matcher must
roll back every rejected draft.

Oracle: the same requests, same constraints, on a plain engine of the same model (no prefix
caching, a pool that never preempts, default step budget, eager, lock-step, no speculation).
Tokens, text, finish reasons must be equal, logprobs (of the masked distribution) within 1e-3;
prompts with a greedy top-2 margin under 1e-3 are dropped (near-ties), an int8 / fp8 cache may
diverge only at a near-tie (see ``combo_fuzz.compare``). Independently of the oracle, every
output of either engine that ended because its grammar completed (``stop`` with no stop
string / token) must satisfy the constraint: ``json.loads`` + ``jsonschema.validate``,
``re.fullmatch`` for a regex and for the grammar's equivalent regex, membership for a choice;
every output cut earlier must be a prefix the grammar still accepts. After each case: no
request left, no block or host swap block held (``combo_fuzz.check_no_leaks``).

    PYTHONPATH=. .venv/bin/python benchmarks/combo_fuzz_structured.py [--start 0] [--n 100]

Prints one line per case; exit status 1 if any case failed. About 0.1-0.5 s a case on a free
core once the engines and grammars are built (models are shared with ``combo_fuzz.py``).
A draft model proposes nothing for a constrained request (``Speculator``), so with a draft
model only the free requests of a batch speculate; the grammar rollback is exercised by
n-gram drafts. Session 29: cases 0-299 (``--sticky 3``) and 300-599: no divergence, no
broken constraint, no leak; with ``num_valid_drafts``' rollback removed (a planted bug),
17 of cases 0-79 fail.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import combo_fuzz as cf  # sets the thread environment and sys.path first
import jsonschema
import xgrammar as xgr

from kvflow import SamplingParams
from kvflow.core import kv_swap
from kvflow.structured import StructuredOutputsParams
from tests.test_structured_output import SCHEMA as STRUCTURED_TEST_SCHEMA

SCHEMA = STRUCTURED_TEST_SCHEMA  # bounded strings, an integer range, an enum array
SCHEMA_FLAT = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                "k": {"enum": ["x", "yz", 3]}},
               "required": ["ok", "k"]}
GRAMMAR = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
# (constraint fields, example of a valid output: its tokens go into prompts)
CONSTRAINTS: list[tuple[dict[str, Any], str]] = [
    ({"json": SCHEMA}, '{"name": "ab c", "age": 42, "tags": ["a", "b"]}'),
    ({"json": SCHEMA_FLAT}, '{"ok": true, "k": "yz"}'),
    ({"json_object": True}, '{"a": [1, 2], "b": {"c": null}}'),
    ({"regex": r"[a-z]{2,6}-\d{2}(\.[0-9])?"}, "abcd-12.5"),
    ({"regex": r"[a-z]{4}( [a-z]{4}){3}"}, "abcd efgh ijkl mnop"),
    ({"choice": ["北京🙂", "東京タワー", "kvflow ✓", "yes", "no"]}, "kvflow ✓"),
    ({"grammar": GRAMMAR}, "(12 + 3 + 45)"),
]
GRAMMAR_REGEX = r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)"


def satisfies(fields: dict[str, Any], text: str) -> bool:
    """Whether ``text`` is a complete output of the constraint ``fields`` (an independent
    check: jsonschema / re / membership, no grammar engine)."""
    if "json" in fields or "json_object" in fields:
        try:
            value = json.loads(text)
            jsonschema.validate(value, fields.get("json", {"type": "object"}))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in fields:
        return re.fullmatch(fields["regex"], text) is not None
    if "choice" in fields:
        return text in fields["choice"]
    return re.fullmatch(GRAMMAR_REGEX, text) is not None


class PrefixChecker:
    """Whether a token sequence is a prefix a grammar accepts: a fresh xgrammar matcher per
    call (the engine's own matcher is never reused), grammars compiled once per constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=[0])
        self.compiler, self.compiled = xgr.GrammarCompiler(info), {}

    def accepts(self, fields: dict[str, Any], token_ids: list[int]) -> bool:
        key = json.dumps(fields, sort_keys=True)
        if key not in self.compiled:
            c = self.compiler
            self.compiled[key] = (
                c.compile_json_schema(json.dumps(fields["json"])) if "json" in fields else
                c.compile_builtin_json_grammar() if "json_object" in fields else
                c.compile_regex(fields["regex"]) if "regex" in fields else
                c.compile_grammar(GRAMMAR) if "grammar" in fields else
                c.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in
                                                           fields["choice"])))
        matcher = xgr.GrammarMatcher(self.compiled[key])
        return all(matcher.accept_token(t) for t in token_ids)


def draw_requests(rng: random.Random, tokenizer: Any, adapters: list | None, priority: bool,
                  sampled: bool) -> list[list[Any]]:
    """3-8 requests [prompt ids, SamplingParams kwargs, arrival step, priority, adapter,
    constraint fields or None]; prompts mix random ids with the tokens of valid outputs."""
    examples = [tokenizer.encode(ex, add_special_tokens=False) for _, ex in CONSTRAINTS]
    base = [rng.randint(2, 319) for _ in range(24)]
    reqs = []
    for _ in range(rng.randint(3, 8)):
        prompt = base[:rng.randint(1, 24)]
        for ex in rng.sample(examples, rng.randint(0, 2)):
            prompt += ex + [rng.randint(2, 319) for _ in range(rng.randint(0, 3))]
        prompt += [7] * (2 - len(prompt))
        max_tokens = rng.choice([1, 2, 3, 5, 8, 12, 20, 30, 40])
        sp: dict[str, Any] = {"temperature": 0, "max_tokens": max_tokens, "logprobs": 2,
                              "ignore_eos": rng.random() < 0.3, "n": rng.choice([1, 1, 2, 3])}
        fields = rng.choice(CONSTRAINTS)[0] if rng.random() < 0.8 else None
        if fields is not None:
            sp["structured_outputs"] = StructuredOutputsParams(**fields)
        if rng.random() < 0.1:
            sp["min_tokens"] = rng.randint(0, max_tokens)
        if sampled and rng.random() < 0.3:
            sp.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randint(0, 1000))
        reqs.append([prompt, sp, rng.choice([0, 0, 0, 1, 3, 6]),
                     rng.randint(-2, 2) if priority else 0,
                     rng.choice([None, *adapters]) if adapters else None, fields])
    return reqs


def check_constraints(reqs: list[Any], outs: list[Any], checker: PrefixChecker) -> int:
    """Every sample of ``outs`` (None: aborted) obeys its request's constraint; returns how
    many were complete structures.

    Raises:
        AssertionError: a complete output that does not satisfy its constraint, or a cut one
            that is not a prefix the grammar accepts.
    """
    complete = 0
    for r, out in zip(reqs, outs):
        fields = r[5]
        if out is None or fields is None:
            continue
        for c in out.outputs:
            toks = list(c.token_ids)
            if toks and toks[-1] == 0:  # the EOS (id 0) that ends a complete grammar
                toks.pop()
            assert checker.accepts(fields, toks), ("not a grammar prefix", fields, c)
            if c.finish_reason == "stop" and c.stop_reason is None:
                assert satisfies(fields, c.text), ("constraint broken", fields, c.text, c)
                complete += 1
    return complete


def one_case(seed: int, config_seed: int, engines: cf.Engines, adapters: list,
             tokenizer: Any, checker: PrefixChecker) -> str:
    """Run case ``seed`` (configuration from ``config_seed``); returns a summary line.

    Raises:
        AssertionError: on a divergence from the oracle, a broken constraint or a leak.
    """
    rng = random.Random(seed)
    model, kw, lora = cf.draw_config(random.Random(config_seed), engines.root)
    spec = "speculative_config" in kw
    reqs = draw_requests(rng, tokenizer, adapters if lora else None,
                         kw.get("policy") == "priority", sampled=not spec)
    llm = engines.get(model, **kw)
    reqs = [r for r in reqs if len(r[0]) + r[1]["max_tokens"] <= llm.engine.core.max_model_len]
    kv_dtype = kw.get("kv_cache_dtype", "auto")
    plain = engines.plain(model, lora, kv_dtype)
    first = cf.run(plain, [(p, SamplingParams(**sp), 0, 0, lr) for p, sp, _, _, lr, _ in reqs])
    kept = [r for r, o in zip(reqs, first) if cf._no_near_tie(o)]
    if not kept:
        return "skipped (near-ties)"
    cf.add_oracle_stops(list(zip(reqs, first)), rng, p_stop_ids=0.2, min_text=4)
    reqs = [(p, SamplingParams(**sp), arr, prio, lr) for p, sp, arr, prio, lr, _ in kept]
    ref = cf.run(plain, [(p, sp, 0, 0, lr) for p, sp, _, _, lr in reqs])
    abort = (rng.randrange(len(reqs)), rng.randint(0, 12)) if rng.random() < 0.2 else None
    got = cf.run(llm, reqs, abort)
    keep = [i for i, g in enumerate(got) if g is not None]
    cf.compare([ref[i] for i in keep], [got[i] for i in keep], kv_dtype != "auto")
    complete = check_constraints(kept, ref, checker)
    check_constraints(kept, got, checker)
    cf.check_no_leaks(llm)
    sched = llm.engine.core.scheduler
    return (f"ok reqs={len(reqs)} constrained={sum(r[5] is not None for r in kept)} "
            f"complete={complete} preemptions={sched.num_preemptions} "
            f"swaps={sched.swap.num_swapped_out if sched.swap else 0} "
            f"accepted={sum(g.metrics.num_accepted_tokens for g in got if g)} {model} {kw}")


def main() -> int:
    args = cf.fuzz_args(__doc__.split("\n")[0], 100)
    kv_swap.SwapManager.should_swap = cf._always_swap
    adapters = cf.build_models(args.models)
    engines = cf.Engines(args.models)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.models, "llama"))
    with open(os.path.join(args.models, "llama", "config.json")) as f:
        checker = PrefixChecker(tokenizer, json.load(f)["vocab_size"])
    return cf.run_cases(args, lambda seed, config: one_case(seed, config, engines, adapters,
                                                            tokenizer, checker))


if __name__ == "__main__":
    sys.exit(main())
