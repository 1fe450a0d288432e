"""Speculative decoding speed at batch 1: decode tokens/s with and without speculation.

Two engines of the same model live in one process: one plain, one with
``--speculative-config``. Each round generates the same greedy completion once with each
(order alternating between rounds, so both see the same machine load); the figure is the
decode rate of the request (output tokens after the first / time from the first token to the
last), its median over rounds, and the ratio speculative / plain. The greedy texts must be
identical (the script says so, and exits 1 otherwise).

The default workload repeats its input: the prompt gives a source file (by default
kvflow/spec_decode/ngram.py) and asks for the whole file back with one change, the kind of
edit where n-gram prompt lookup pays::

    .venv/bin/python benchmarks/spec_decode.py --model Qwen2.5-Coder-0.5B-Instruct \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

``--prompt "..."`` replaces the workload with a plain completion prompt (a code-completion
prompt for a draft model, say). ``--batch N`` (N > 1) sends N such requests at once (the edit
asks for a different new name in each) and the figure becomes output tokens per second of the
whole batch (wall time of the generate call): the check that adaptive lengths stop
speculating where verification costs more than it saves. The last line is ``ratio=X``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvflow import LLM, SamplingParams

EDIT_REQUEST = ("Here is a Python file:\n\n```python\n{source}```\n\nRename the function "
                "`_matches` to `_suffix_matches{suffix}` everywhere and print the whole updated file "
                "in one ```python block, with nothing else changed.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    p.add_argument("--speculative-config", required=True, help="JSON, as kvflow's flag")
    p.add_argument("--source", default=str(ROOT / "kvflow/spec_decode/ngram.py"),
                   help="the file the edit workload repeats")
    p.add_argument("--prompt", default=None, help="a plain completion prompt instead")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="requests sent at once")
    p.add_argument("--extra", default="{}", help="JSON object of extra LLM(...) options")
    return p.parse_args(argv)


def build_prompts(args: argparse.Namespace, llm: LLM) -> list[str]:
    """``--batch`` chat-formatted edit requests (or ``--prompt`` as given, repeated)."""
    if args.prompt is not None:
        return [args.prompt] * args.batch
    source, tokenizer = Path(args.source).read_text(), llm.get_tokenizer()
    suffixes = [""] if args.batch == 1 else [f"_{i}" for i in range(args.batch)]
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": EDIT_REQUEST.format(source=source, suffix=suffix)}],
        tokenize=False, add_generation_prompt=True) for suffix in suffixes]


def one_run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, str, dict]:
    """Tokens/s: one request's decode rate (tokens after the first over the time from the
    first token to the last), or with several the batch's output tokens over the wall time;
    the texts, and the speculative-decoding counts summed over the requests."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    num = sum(len(o.outputs[0].token_ids) for o in outs)
    if len(outs) == 1:
        m = outs[0].metrics
        rate = (num - 1) / max(m.finished_time - m.first_token_time, 1e-9)
    else:
        rate = num / wall
    counts = {"tokens": num, "drafts": sum(o.metrics.num_drafts for o in outs),
              "draft_tokens": sum(o.metrics.num_draft_tokens for o in outs),
              "accepted": sum(o.metrics.num_accepted_tokens for o in outs)}
    return rate, "\x00".join(o.outputs[0].text for o in outs), counts


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout


def machine() -> str:
    """uptime (load average) and the CPU model line, for the record."""
    load = _run(["uptime"]).strip()
    cpu = next((line.split(":", 1)[1].strip() for line in _run(["lscpu"]).splitlines()
                if line.startswith("Model name")), "?")
    return f"{load} | {cpu} | {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = json.loads(args.extra)
    plain = LLM(model=args.model, **extra)
    spec = LLM(model=args.model, speculative_config=args.speculative_config, **extra)
    prompt = build_prompts(args, plain)
    print(f"start: {machine()}")
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    texts: dict[str, set[str]] = {"plain": set(), "spec": set()}
    counts = {}
    one_run(plain, prompt[:1], 8), one_run(spec, prompt[:1], 8)  # warm-up
    for r in range(args.rounds):
        order = [("plain", plain), ("spec", spec)]
        for name, llm in order if r % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            rate, text, c = one_run(llm, prompt, args.max_tokens)
            rates[name].append(rate)
            texts[name].add(text)
            counts[name] = c
            print(f"round {r} {name}: {rate:.2f} tok/s, {c}, "
                  f"{time.perf_counter() - started:.1f} s")
    same = texts["plain"] == texts["spec"] and len(texts["plain"]) == 1
    c = counts["spec"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"end: {machine()}")
    print(f"model={args.model} speculative_config={args.speculative_config} "
          f"batch={args.batch} output_tokens={c['tokens']} identical_greedy_text={same}")
    print(f"acceptance_rate={c['accepted'] / max(c['draft_tokens'], 1):.3f} "
          f"mean_acceptance_length={1 + c['accepted'] / max(c['drafts'], 1):.2f}")
    print(f"plain_median={med['plain']:.2f} tok/s spec_median={med['spec']:.2f} tok/s")
    print(f"ratio={med['spec'] / med['plain']:.3f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
