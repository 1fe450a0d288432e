"""An EAGLE-3 engine's decode speed with CPU step graphs against ``--enforce-eager``, both
engines in one process, interleaved (graphs, eager, eager, graphs, ...) so that both see the same
load of a shared machine. Each measurement is the decode time per step, ``(t(N tokens) - t(1
token)) / (N - 1)`` of B of CPU-W1's 128-token prompts (greedy, EOS ignored, adaptive draft
lengths off: every step verifies 1 + k tokens a request); the figures are medians over the
rounds and the ratio eager / graphs. Both engines' greedy outputs must be equal (exit 1
otherwise)::

    .venv/bin/python benchmarks/make_eagle3_head.py out/smollm2-hf /tmp/eagle3-head
    .venv/bin/python benchmarks/eagle3_step_graphs.py out/smollm2-hf /tmp/eagle3-head
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("head_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", type=int, default=33, help="N, output tokens per request")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import offline_engine

    spec = {"method": "eagle3", "model": args.head_dir, "num_speculative_tokens": args.k,
            "adaptive": False}
    engines = {mode: offline_engine.load_engine("kvflow", args.model_dir, args.dtype,
                                                enforce_eager=mode == "eager",
                                                speculative_config=spec)[:2]
               for mode in ("graphs", "eager")}
    ids = offline_engine.cpu_w1_token_ids(engines["graphs"][0].get_tokenizer().vocab_size, 8)
    texts = {}
    for mode, (llm, params) in engines.items():  # warm-up; the outputs must agree
        outs = llm.generate(ids, params(temperature=0, max_tokens=args.tokens,
                                        ignore_eos=True), use_tqdm=False)
        texts[mode] = [o.outputs[0].token_ids for o in outs]
    if texts["graphs"] != texts["eager"]:
        print("greedy outputs differ between graphs and eager")
        sys.exit(1)
    for b in (int(x) for x in args.batches.split(",")):
        ms = {"graphs": [], "eager": []}
        for rnd in range(args.rounds):
            for mode in ("graphs", "eager") if rnd % 2 == 0 else ("eager", "graphs"):
                llm, params = engines[mode]
                one = offline_engine.greedy_run(llm, params, ids[:b], 1)[0]
                full = offline_engine.greedy_run(llm, params, ids[:b], args.tokens)[0]
                ms[mode].append((full - one) / (args.tokens - 1) * 1e3)
        med = {mode: statistics.median(v) for mode, v in ms.items()}
        print(f"b{b}: graphs {med['graphs']:.2f} ms/step, eager {med['eager']:.2f} ms/step, "
              f"eager / graphs {med['eager'] / med['graphs']:.3f}; rounds graphs "
              f"{[round(x, 1) for x in ms['graphs']]} eager {[round(x, 1) for x in ms['eager']]}",
              flush=True)
    graphs = engines["graphs"][0].engine.core.executor.runner.graph_runner
    print(f"replayed={graphs.replayed_steps} programs={sorted(graphs.programs)} "
          f"refused={sorted(graphs.refused)}")


if __name__ == "__main__":
    main()
