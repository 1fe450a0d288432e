"""Acceptance of drafts for seeded requests (verified by the seeded-token rule: a draft is
accepted iff it is the token plain seeded sampling draws there) against unseeded ones
(rejection sampling, Leviathan et al. 2023), same prompts, same sampling parameters; and
whether each seeded output equals the plain engine's (no speculation).

For each speculator (n-gram; the model drafting for itself with INT8 and INT4 weights, so
the draft's ``q`` differs from the target's ``p`` as a small draft's would), one engine runs
``--prompts`` prompts x ``--seeds`` samples twice: seeded (seeds 0..S-1) and unseeded.
Prints draft tokens, accepted tokens and the acceptance rate of each, and how many seeded
outputs are token for token the plain engine's::

    .venv/bin/python benchmarks/seeded_acceptance.py --model out/smollm2-hf

``--deterministic`` builds every engine with ``deterministic=True`` (logits bitwise plain
decoding's, so every seeded output must be the plain one) and runs n-gram only (the mode
refuses a quantized draft); ``--max-num-batched-tokens`` cuts drafts.

Unseeded acceptance is itself random: compare rates with their run-to-run spread in mind
(the script prints the binomial standard error of each rate).
"""

from __future__ import annotations

import argparse
import math

from kvflow import LLM, SamplingParams

TEXT = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n\n\ndef factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n"
        "        result *= i\n    return result\n")
PROMPTS = [
    f"Rename the function fibonacci to fib in this code and repeat it:\n{TEXT}\n",
    f"Add a docstring to each function of this code:\n{TEXT}\n",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, step by step.",
    "List the planets of the solar system with one fact about each.",
    ("Summarize: The quick brown fox jumps over the lazy dog. The dog does not move. The fox "
     "jumps again, and the dog finally wakes up and chases the fox into the forest."),
    "What are the main differences between Python lists and tuples?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="out/smollm2-hf")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--seeds", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--deterministic", action="store_true", help="n-gram only, bitwise logits")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    return p.parse_args(argv)


def requests(args: argparse.Namespace, seeded: bool) -> tuple[list[str], list[SamplingParams]]:
    """Each prompt ``--seeds`` times; sample ``j`` seeded ``j`` when ``seeded``."""
    prompts, params = [], []
    for prompt in PROMPTS[:args.prompts]:
        for j in range(args.seeds):
            prompts.append(prompt)
            params.append(SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                         max_tokens=args.max_tokens, ignore_eos=True,
                                         seed=j if seeded else None))
    return prompts, params


def speculators(args: argparse.Namespace) -> dict[str, dict]:
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False}
    draft = {"method": "draft_model", "model": args.model, "num_speculative_tokens": args.k,
             "adaptive": False}
    if args.deterministic:
        return {"ngram": ngram}
    return {"ngram": ngram, "draft int8": {**draft, "quantization": "int8"},
            "draft int4": {**draft, "quantization": "int4"}}


def engine(args: argparse.Namespace, spec: dict | None = None) -> LLM:
    kw = {"max_num_batched_tokens": args.max_num_batched_tokens} \
        if args.max_num_batched_tokens else {}
    return LLM(model=args.model, max_model_len=1024, deterministic=args.deterministic,
               speculative_config=spec, **kw)


def rate(outs) -> str:
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    r = accepted / drafted if drafted else float("nan")
    err = math.sqrt(r * (1 - r) / drafted) if drafted else float("nan")
    return f"{drafted:6d} {accepted:6d} {r:7.3f} +- {err:.3f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts, seeded = requests(args, True)
    _, unseeded = requests(args, False)
    plain = engine(args)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, seeded, use_tqdm=False)]
    plain.shutdown()
    del plain
    print(f"{'speculator':12s} {'mode':9s} {'drafts':>6s} {'accept':>6s} {'rate':>7s}"
          "   identical to plain")
    for name, spec in speculators(args).items():
        llm = engine(args, spec)
        outs = llm.generate(prompts, seeded, use_tqdm=False)
        same = sum(o.outputs[0].token_ids == r for o, r in zip(outs, reference))
        print(f"{name:12s} {'seeded':9s} {rate(outs)}   {same}/{len(outs)}")
        print(f"{name:12s} {'unseeded':9s} {rate(llm.generate(prompts, unseeded, use_tqdm=False))}")
        llm.shutdown()
        del llm


if __name__ == "__main__":
    main()
