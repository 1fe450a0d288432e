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

``--workload completion`` runs instead a few built-in code-completion prompts (raw code, no chat
template: the start of a function the model completes), one after the other at batch 1; the
figure is their decode tokens over their decode time. That is the draft-model workload::

    .venv/bin/python benchmarks/spec_decode.py --model Qwen2.5-Coder-1.5B-Instruct \
        --workload completion --one-engine-at-a-time --max-tokens 64 --rounds 2 \
        --speculative-config '{"method": "draft_model", "model": "Qwen2.5-Coder-0.5B-Instruct"}' \
        --extra '{"kv_cache_memory": "256MiB"}'

``--one-engine-at-a-time`` builds each round's engine, runs it and frees it before the next
(the rounds still alternate; each build is warmed up before it is timed): two 1.5B engines and
a draft at once do not fit a shared machine's memory. After the rounds the script prints the
speculating engine's acceptance rate per draft position and its measured step costs (the
target's step of 1 token and of 1 + K tokens, one draft pass), which say why speculation pays
or not. ``--prompt "..."`` replaces the workload with one plain prompt. ``--batch N`` (N > 1)
sends N such requests at once (the edit asks for a different new name in each; the completion
prompts get a distinct first line, ``# example i``) and the figure becomes output tokens per
second of the whole batch (wall time of the generate call): the check that adaptive lengths
stop speculating where verification costs more than it saves. ``--spec-off-too`` adds a third
engine, the speculating one with its cost model told never to draft (``min_gain`` infinite):
what a speculating engine costs when speculation is off (its proposer and cost model still run
every step, its KV pool still holds the draft's K/V). ``--single-engine`` builds only the
speculating engine (one build of a 1.5B target and its draft takes minutes on a loaded 2-core
machine) and runs it in each round as ``plain`` (told never to draft, as ``spec_off``) and ``spec``
(with ``--fixed-too`` also ``fixed``: adaptive lengths off, K drafts every step), and prints
each mode's verification steps: drafted and accepted tokens per step, by length. ``--variant NAME=JSON`` (repeatable) adds
a speculating engine whose config is ``--speculative-config`` with JSON's keys replaced (e.g.
``int8='{"quantization": "int8"}'``), run in the same rounds, so that variants are compared
under the same load; each gets its median and ratio to plain. Each round line counts the
preemptions.
The last line is ``ratio=X``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvflow import LLM, SamplingParams

COMPLETION_PROMPTS = (
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number (fib(0) = 0)."""\n',
    ("import numpy as np\n\n\ndef softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:\n"
     '    """Numerically stable softmax of x along axis."""\n'),
    ("class Stack:\n    \"\"\"A LIFO stack backed by a Python list.\"\"\"\n\n"
     "    def __init__(self) -> None:\n        self._items = []\n\n    def push(self, item):\n"),
    ("def is_palindrome(text: str) -> bool:\n"
     '    """True if text reads the same backwards, ignoring case and non-letters."""\n'),
)
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
    p.add_argument("--workload", default="edit", choices=["edit", "completion"],
                   help="edit: the input-repeating edit request; completion: code-completion "
                        "prompts, one at a time")
    p.add_argument("--one-engine-at-a-time", action="store_true",
                   help="build and free each round's engine (memory)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="requests sent at once")
    p.add_argument("--extra", default="{}", help="JSON object of extra LLM(...) options")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="another speculating engine in the same rounds: the speculative "
                        "config JSON merged over --speculative-config's (repeatable)")
    p.add_argument("--single-engine", action="store_true",
                   help="build only the speculating engine; its rounds run it as 'plain' "
                        "(cost model told never to draft) and 'spec' (as configured)")
    p.add_argument("--fixed-too", action="store_true",
                   help="with --single-engine: also as 'fixed' (adaptive lengths off: "
                        "always K drafts)")
    p.add_argument("--spec-off-too", action="store_true",
                   help="a third engine: the speculating one with its cost model told never "
                        "to draft (what speculation costs when it is off)")
    return p.parse_args(argv)


def build_prompts(args: argparse.Namespace, llm: LLM) -> list[str]:
    """``--batch`` chat-formatted edit requests (or ``--prompt`` as given, repeated; or the
    code-completion prompts)."""
    if args.prompt is not None:
        return [args.prompt] * args.batch
    if args.workload == "completion":
        if args.batch == 1:
            return list(COMPLETION_PROMPTS)
        return [f"# example {i}\n" + COMPLETION_PROMPTS[i % len(COMPLETION_PROMPTS)]
                for i in range(args.batch)]
    source, tokenizer = Path(args.source).read_text(), llm.get_tokenizer()
    suffixes = [""] if args.batch == 1 else [f"_{i}" for i in range(args.batch)]
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": EDIT_REQUEST.format(source=source, suffix=suffix)}],
        tokenize=False, add_generation_prompt=True) for suffix in suffixes]


def one_run(llm: LLM, prompts: list[str], max_tokens: int,
            one_at_a_time: bool = False) -> tuple[float, str, dict]:
    """Tokens/s: one request's decode rate (tokens after the first over the time from the
    first token to the last; with ``one_at_a_time`` the prompts run one after the other and
    their decode tokens and times are summed), or with several at once the batch's output
    tokens over the wall time; the texts, and the speculative-decoding counts summed over the
    requests."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    started = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    num = sum(len(o.outputs[0].token_ids) for o in outs)
    if len(outs) == 1 or one_at_a_time:
        decode = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
        rate = (num - len(outs)) / max(decode, 1e-9)
    else:
        rate = num / wall
    counts = {"tokens": num, "drafts": sum(o.metrics.num_drafts for o in outs),
              "draft_tokens": sum(o.metrics.num_draft_tokens for o in outs),
              "accepted": sum(o.metrics.num_accepted_tokens for o in outs)}
    return rate, "\x00".join(o.outputs[0].text for o in outs), counts


def spec_report(llm: LLM) -> str:
    """The speculating engine's record over its life (warm-up included): accepted drafts per
    position, and the cost model's measured step times (target: seconds per step by tokens in
    the step; draft: seconds per pass by requests in the pass, first the passes timed at
    start-up, then as averaged with the passes measured while serving)."""
    sp = llm.engine.core.speculator
    lines = [(f"drafts={sp.num_drafts} draft_tokens={sp.num_draft_tokens} "
             f"accepted={sp.num_accepted_tokens} accepted_per_position="
             f"{sp.num_accepted_per_pos}")]
    if sp.draft_passes_at_start:
        lines.append("draft passes timed at start-up, by requests: " + ", ".join(
            f"{rows}: {seconds * 1e3:.1f} ms" for rows, seconds in sp.draft_passes_at_start))
    for name, times in (("target", sp.target_times), ("draft", sp.draft_times)):
        if times is None:
            continue
        seen = np.flatnonzero(times.last_seen >= 0)
        bins = ", ".join(f"{times.counts[b]:.0f}: {times.seconds[b] * 1e3:.1f} ms" for b in seen)
        lines.append(f"{name} step times by count: {bins}")
    return "\n".join(lines)


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout


def machine() -> str:
    """uptime (load average) and the CPU model line, for the record."""
    load = _run(["uptime"]).strip()
    cpu = next((line.split(":", 1)[1].strip() for line in _run(["lscpu"]).splitlines()
                if line.startswith("Model name")), "?")
    return f"{load} | {cpu} | {os.cpu_count()} CPUs"


def build(args: argparse.Namespace, name: str, prompts: list[str] | None) -> LLM:
    """The ``plain`` or ``spec`` engine, warmed up on the first prompt (8 tokens)."""
    spec = None if name == "plain" else variant_config(args, name)
    llm = LLM(model=args.model, speculative_config=spec, **json.loads(args.extra))
    if name == "spec_off":  # the engine runs its proposer and cost model, which say no
        llm.engine.core.speculator.min_gain = math.inf
    one_run(llm, (prompts or build_prompts(args, llm))[:1], 8)
    return llm


def variant_names(args: argparse.Namespace) -> list[str]:
    """The ``--variant`` engines' names, in order."""
    return [v.split("=", 1)[0] for v in args.variant]


def variant_config(args: argparse.Namespace, name: str) -> str:
    """The speculative config JSON of engine ``name`` (``spec``, ``spec_off`` or a
    ``--variant``: its JSON merged over ``--speculative-config``'s)."""
    for v in args.variant:
        key, _, value = v.partition("=")
        if key == name:
            return json.dumps({**json.loads(args.speculative_config), **json.loads(value)})
    return args.speculative_config


def set_mode(llm: LLM, name: str) -> None:
    """``--single-engine``: make the speculating engine run as ``plain`` (never drafts: the
    plain engine's steps, its proposer and cost model still running), ``spec`` (as
    configured) or ``fixed`` (adaptive lengths off)."""
    sp = llm.engine.core.speculator
    if not hasattr(sp, "_bench_adaptive"):
        sp._bench_adaptive, sp._bench_min_gain = sp.config.adaptive, sp.min_gain
    sp.min_gain = math.inf if name == "plain" else sp._bench_min_gain
    sp.config.adaptive = sp._bench_adaptive and name != "fixed"


def record_steps(llm: LLM, mode: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Spy on the speculator's verifications: ``{mode: [(drafted, accepted), ...]}``, one pair
    per request and verification step, under the mode ``mode[0]`` names at the time."""
    sp, steps = llm.engine.core.speculator, {}
    original = sp.record

    def spy(request, num_draft_tokens: int, num_accepted: int) -> None:
        steps.setdefault(mode[0], []).append((num_draft_tokens, num_accepted))
        original(request, num_draft_tokens, num_accepted)

    sp.record = spy
    return steps


def step_histograms(steps: list[tuple[int, int]]) -> str:
    """Verification steps with drafts: how many, drafted and accepted per step (mean and
    count by length), tokens per step (accepted + 1)."""
    drafted = np.array([d for d, _ in steps])
    accepted = np.array([a for _, a in steps])
    if not len(steps):
        return "no verification steps"
    return (f"steps={len(steps)} drafted/step={drafted.mean():.2f} "
            f"accepted/step={accepted.mean():.2f} tokens/step={1 + accepted.mean():.2f} "
            f"drafted_by_length={np.bincount(drafted).tolist()} "
            f"accepted_by_length={np.bincount(accepted).tolist()}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sequential = args.workload == "completion" and args.batch == 1
    names = ["plain", "spec"] + (["spec_off"] if args.spec_off_too else []) + \
        variant_names(args)
    engines: dict[str, LLM] = {}
    if args.single_engine:
        names = ["plain", "spec"] + (["fixed"] if args.fixed_too else [])
        llm = build(args, "spec", None)
        engines = {name: llm for name in names}
        mode = ["plain"]
        steps = record_steps(llm, mode)
    elif not args.one_engine_at_a_time:
        engines = {name: build(args, name, None) for name in names}
    prompts: list[str] | None = build_prompts(args, engines["plain"]) if engines else None
    print(f"start: {machine()}")
    rates: dict[str, list[float]] = {name: [] for name in names}
    texts: dict[str, set[str]] = {name: set() for name in names}
    counts, reports = {}, {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            llm = engines.get(name) or build(args, name, prompts)
            prompts = prompts or build_prompts(args, llm)
            if args.single_engine:
                set_mode(llm, name)
                mode[0] = name
            started = time.perf_counter()
            preempted = llm.engine.core.scheduler.num_preemptions
            rate, text, c = one_run(llm, prompts, args.max_tokens, sequential)
            c["preemptions"] = llm.engine.core.scheduler.num_preemptions - preempted
            rates[name].append(rate)
            texts[name].add(text)
            counts[name] = c
            print(f"round {r} {name}: {rate:.2f} tok/s, {c}, "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
            if name in ("spec", "fixed") or name in variant_names(args):
                reports[name] = spec_report(llm)
            if name not in engines:
                del llm
                gc.collect()
    same = all(texts[name] == texts["plain"] for name in names) and len(texts["plain"]) == 1
    c = counts["spec"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"end: {machine()}")
    print(reports.get("spec", ""))
    print(f"model={args.model} speculative_config={args.speculative_config} "
          f"batch={args.batch} output_tokens={c['tokens']} identical_greedy_text={same}")
    if not same:
        for name in names:
            print(f"{name} texts: {[t.split(chr(0)) for t in texts[name]]}")
    print(f"acceptance_rate={c['accepted'] / max(c['draft_tokens'], 1):.3f} "
          f"mean_acceptance_length={1 + c['accepted'] / max(c['drafts'], 1):.2f}")
    print(f"plain_median={med['plain']:.2f} tok/s spec_median={med['spec']:.2f} tok/s")
    if "spec_off" in med:
        print(f"spec_off_median={med['spec_off']:.2f} tok/s "
              f"spec_off_ratio={med['spec_off'] / med['plain']:.3f}")
    for name in variant_names(args) + (["fixed"] if "fixed" in names else []):
        v = counts[name]
        print(f"variant {name}: {variant_config(args, name)}\n{reports.get(name, '')}\n"
              f"variant {name}: acceptance_rate="
              f"{v['accepted'] / max(v['draft_tokens'], 1):.3f} median={med[name]:.2f} tok/s "
              f"ratio={med[name] / med['plain']:.3f}")
    if args.single_engine:
        for name in names[1:]:
            print(f"verification steps of {name} (timed rounds): "
                  f"{step_histograms(steps.get(name, []))}")
    print(f"ratio={med['spec'] / med['plain']:.3f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
