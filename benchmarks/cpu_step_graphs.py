"""CPU step graphs against eager steps (``--enforce-eager``), one kvflow tree, same workload.

Each round starts one process per mode, the modes alternating (graphs, eager, graphs, ...).
A process loads the model (prefix caching off, as ``offline_engine.py``), warms up, then
measures:

* decode ms/step at batch B (1, 8, 64 by default): ``(t(64 tokens) - t(1 token)) / 63`` for
  the first B prompts of CPU-W1's 64 x 128 random token ids, greedy, EOS ignored; the best
  of 3 runs each;
* CPU-W1 throughput: all 64 prompts, 64 tokens each, output tok/s, the median of 3 runs.

The last lines give each mode's medians over the rounds and the ratio graphs / eager::

    .venv/bin/python benchmarks/cpu_step_graphs.py MODEL_DIR [--dtype bfloat16] [--rounds 3]

``--quantization int8`` loads the model so; ``--before DIR`` compares this tree's graphs with
another kvflow tree's (e.g. ``git archive`` of an earlier commit, its step graphs on too)
instead of eager steps, the processes alternating the same way; ``--no-throughput`` skips
CPU-W1. Each process also reports ``replayed``, the decode steps its step graphs replayed.
``--speculative-config JSON`` gives both modes that speculative config (e.g. an EAGLE-3 head
from ``make_eagle3_head.py``, adaptive lengths off): the steps are then verification steps of
1 + k tokens per request, which the step graphs replay too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

NUM_PROMPTS, OUTPUT_LEN = 64, 64  # prompts of offline_engine.INPUT_LEN (128) tokens
MODES = ("graphs", "eager")
BEFORE_MODES = ("graphs", "before")  # with --before: this tree, then the other, both graphs on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes, comma-separated")
    p.add_argument("--quantization", default=None, help="e.g. int8 (default: as loaded)")
    p.add_argument("--before", default=None,
                   help="another kvflow tree to compare with instead of eager steps")
    p.add_argument("--no-throughput", action="store_true", help="skip CPU-W1 throughput")
    p.add_argument("--speculative-config", default=None,
                   help="JSON speculative_config for both modes (default: none)")
    p.add_argument("--child", choices=(*MODES, "before"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One process's figures: {"b<B>_ms": decode ms/step, "tok_s": CPU-W1 out tok/s}."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import offline_engine

    llm, params_cls, _ = offline_engine.load_engine(
        "kvflow", args.model_dir, args.dtype, enforce_eager=args.child == "eager",
        quantization=args.quantization,
        speculative_config=json.loads(args.speculative_config or "null"))
    vocab = llm.get_tokenizer().vocab_size
    ids = offline_engine.cpu_w1_token_ids(vocab, NUM_PROMPTS)

    def run(batch: list, max_tokens: int) -> float:
        return offline_engine.greedy_run(llm, params_cls, batch, max_tokens)[0]

    run(ids[:2], 4)  # warm-up
    result = {}
    for b in (int(x) for x in args.batches.split(",")):
        one = min(run(ids[:b], 1) for _ in range(3))
        full = min(run(ids[:b], OUTPUT_LEN) for _ in range(3))
        result[f"b{b}_ms"] = (full - one) / (OUTPUT_LEN - 1) * 1e3
    if not args.no_throughput:
        result["tok_s"] = statistics.median(
            NUM_PROMPTS * OUTPUT_LEN / run(ids, OUTPUT_LEN) for _ in range(3))
    graphs = llm.engine.core.executor.runner.graph_runner
    result["replayed"] = float(getattr(graphs, "replayed_steps", 0))
    return result


def compare(args: argparse.Namespace) -> None:
    modes = BEFORE_MODES if args.before else MODES
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for rnd in range(args.rounds):
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), args.model_dir, "--dtype",
                   args.dtype, "--batches", args.batches, "--child", mode]
            cmd += ["--quantization", args.quantization] if args.quantization else []
            cmd += ["--no-throughput"] if args.no_throughput else []
            cmd += ["--speculative-config", args.speculative_config] \
                if args.speculative_config else []
            env = dict(os.environ)
            if mode == "before":  # the other tree's kvflow, imported first
                env["PYTHONPATH"] = os.pathsep.join(
                    [os.path.abspath(args.before), *filter(None, [env.get("PYTHONPATH")])])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {rnd} {mode}: " + " ".join(
                f"{k}={v:.2f}" for k, v in runs[mode][-1].items()), flush=True)
    medians = {mode: {k: statistics.median(r[k] for r in results) for k in results[0]}
               for mode, results in runs.items()}
    for mode, figures in medians.items():
        print(f"{mode}: " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()))
    base = modes[1]
    print(f"graphs / {base}: " + " ".join(
        f"{k}={medians['graphs'][k] / medians[base][k]:.3f}" for k in medians["graphs"]
        if medians[base][k]))


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(measure(args)))
    else:
        compare(args)


if __name__ == "__main__":
    main()
