"""Same results before and after: greedy tokens and offline throughput of two kvflow trees.

Each source tree runs in its own process (``PYTHONPATH`` set to the tree, the same Python and
venv) on the packaged SmolLM2-135M-Instruct: a fixed set of chat-style text prompts and the
CPU-W1 shape (``--num-prompts`` random-token prompts of ``--input-len`` tokens, seed 0 ->
``--output-len`` greedy tokens, EOS ignored, prefix caching off), in ``--dtype`` (default
float32; ``bfloat16`` for issue 23's offline CPU-W1 comparison). The trees run in turn
for ``--rounds`` rounds (the order flips every round) so both see the same machine load. The script prints, per tree, the
median output tokens/s and then how many of the sequences are token-for-token identical to the
first tree's (and where the first divergence is, if any).

Run (``git worktree add /work/wt/baseline-5e92c6e 5e92c6e`` first)::

    .venv/bin/python benchmarks/compare_trees.py --trees /work/wt/baseline-5e92c6e . --rounds 3

Greedy decoding on random-token prompts meets near-ties in the logits; a divergence late in a
sequence whose two candidates were within fp32 rounding of each other is reported with the gap
between the first tree's top-2 logprobs at that position, so a reader can tell a kernel-rounding
tie from a behaviour change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TEXT_PROMPTS = [
    "The capital of France is",
    "Write a Python function that reverses a string.",
    "Once upon a time, in a small village,",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Explain what a KV cache is in one sentence.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", help="the model dtype of both trees' runs")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_child(args: argparse.Namespace) -> None:
    """Generate in this process (the kvflow on sys.path) and print one JSON line."""
    import torch

    from kvflow import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    vocab = llm.get_tokenizer().vocab_size
    gen = torch.Generator().manual_seed(0)
    random_prompts = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()
                      for _ in range(args.num_prompts)]
    text_params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    w1_params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                               logprobs=2)
    text = llm.generate(TEXT_PROMPTS, text_params, use_tqdm=False)
    start = time.perf_counter()
    w1 = llm.generate(random_prompts, w1_params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    outputs = [summarize(o) for o in text + w1]
    print("RESULT " + json.dumps({"tok_per_s": args.num_prompts * args.output_len / elapsed,
                                  "outputs": outputs}))


def summarize(request_output) -> dict:
    """Token ids and, per position, the gap between the top-2 logprobs (nats)."""
    c = request_output.outputs[0]
    gaps = []
    for pos in c.logprobs or []:
        top = sorted((lp.logprob for lp in pos.values()), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return {"token_ids": list(c.token_ids), "gaps": gaps}


def run_tree(tree: str, args: argparse.Namespace) -> dict:
    """One child process for ``tree``; returns its RESULT object."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model,
           "--dtype", args.dtype,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"tree {tree} failed:\n{proc.stderr[-3000:]}")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(before: dict, after: dict) -> None:
    """Print identical-sequence counts and each divergence with its top-2 gap."""
    same = 0
    for i, (x, y) in enumerate(zip(before["outputs"], after["outputs"])):
        pos = first_divergence(x["token_ids"], y["token_ids"])
        if pos is None:
            same += 1
            continue
        gap = x["gaps"][pos] if pos < len(x["gaps"]) else float("nan")
        kind = "text" if i < len(TEXT_PROMPTS) else "w1"
        print(f"  diverges: {kind} #{i} at token {pos}, before's top-2 gap {gap:.2e} nats")
    print(f"identical sequences: {same}/{len(before['outputs'])}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    results: dict[str, list[dict]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        order = args.trees if r % 2 == 0 else args.trees[::-1]  # ABBA: no order advantage
        for tree in order:
            res = run_tree(tree, args)
            results[tree].append(res)
            print(f"round {r + 1} {tree}: {res['tok_per_s']:.1f} output tok/s", flush=True)
    medians = [statistics.median(x["tok_per_s"] for x in results[t]) for t in args.trees]
    for tree, med in zip(args.trees, medians):
        print(f"{tree}: median {med:.1f} output tok/s")
    print(f"ratio after/before: {medians[1] / medians[0]:.3f}")
    compare(results[args.trees[0]][0], results[args.trees[1]][0])


if __name__ == "__main__":
    main()
