"""Differential fuzz of feature combinations in the offline engine (``kvflow.LLM``).

Each case draws, from its seed, one engine configuration out of prefix caching, chunked prefill
(``max_num_batched_tokens`` 1-64 or the default), a small KV pool (preemption), preemption by
recompute or swap (swap forced whenever the host pool fits, so small requests take that path
too), speculative decoding (n-gram, the target as its own draft, another model as the draft),
multi-LoRA (three PEFT adapters and the base model in one batch; ``max_loras`` 1-3), the
priority policy, async scheduling, CPU step graphs (``enforce_eager`` off), ``max_num_seqs``
1-4, block sizes 1-16 and an int8 / fp8 KV cache; on tiny random fp32 models (Llama, Mixtral,
Mistral with a sliding window, Qwen2 with windowed and full layers, Gemma 3, DeepSeek-V2 MLA).
Its 3-10 requests share prefixes, arrive over the first steps, and draw n (1-3), max_tokens
(1, to the end of the context, ...), min_tokens, stop strings and stop token ids taken from the
oracle's own output, prompt logprobs, seeded sampling (configurations without speculative
decoding), an abort in flight.

Oracle: the same requests on a plain engine of the same model (no prefix caching, a pool large
enough for every request, default step budget, eager, lock-step, recompute). Tokens, text and
finish reasons must be equal, logprobs within 1e-3; an int8 / fp8 KV cache is compared with a
plain engine of the same cache dtype, and a divergence is accepted only at a near-tie (top-2
within 0.1). Prompts whose greedy top-2 logprob margin is below 1e-3 anywhere are dropped
(near-ties). After each case: no request left, the block pool passes ``check_invariants`` with
every usable block free, no swapped request or host block held.

    PYTHONPATH=. .venv/bin/python benchmarks/combo_fuzz.py [--start 0] [--n 200] [--sticky 10]

``--sticky K`` keeps each configuration for K consecutive cases, so one engine serves many
batches (cached blocks of earlier cases, LRU evictions). Prints one line per case; exit status
1 if any case failed. About 0.1-0.5 s a case on a free core after the engines start.
Session 29 (the script's first version, same draws): 1,650 cases, no divergence, no leak;
with the LoRA id taken out of the prefix-cache key (a planted bug) 9 of cases 0-79 fail.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KVFLOW_CPU_ADAPTIVE_THREADS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvflow import LLM, SamplingParams
from kvflow.core import kv_swap
from kvflow.lora.request import LoRARequest

MODELS = ["llama", "llama_mqa", "mixtral", "mistral_sliding_window", "qwen2_layer_types",
          "gemma3", "deepseek_v2"]
_LORA_MODULES = [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                 ["q_proj", "v_proj", "down_proj"], ["k_proj", "v_proj", "up_proj"]]
NEAR_TIE = 1e-3  # top-2 logprob margin below which a prompt is dropped
LOGPROB_TOL = 1e-3  # fp32
QUANT_TIE = 0.1  # margin under which an int8 / fp8 cache may pick the other token


def build_models(root: str) -> list[LoRARequest]:
    """Save the tiny models and three LoRA adapters of the base Llama under ``root`` (kept
    between runs: a folder that already has them is reused); returns the adapters."""
    from tests import conftest
    from tests.lora.adapters import make_adapter

    tokenizer = None
    for name in MODELS:
        folder = os.path.join(root, name)
        if not os.path.exists(os.path.join(folder, "config.json")):
            tokenizer = tokenizer or conftest.tiny_tokenizer.__wrapped__()
            conftest.build_tiny_model(name, folder, tokenizer, zlib.crc32(name.encode()))
    adapters = []
    for i, modules in enumerate(_LORA_MODULES, start=1):
        folder, rank = os.path.join(root, f"lora{i}"), 4 if i == 2 else 8
        if not os.path.exists(os.path.join(folder, "adapter_config.json")):
            make_adapter(os.path.join(root, "llama"), folder, i, r=rank, lora_alpha=2 * rank,
                         target_modules=modules)
        adapters.append(LoRARequest(f"l{i}", i, folder))
    return adapters


def _always_swap(self: kv_swap.SwapManager, request: Any) -> bool:
    """``SwapManager.should_swap`` forced: swap whenever the host pool fits (the cost model
    alone swaps only contexts of 256+ tokens before it is fitted, which tiny cases never
    reach)."""
    held = sum(self.kv.num_held_blocks(request.request_id))
    return request.num_computed_tokens > 0 and 0 < held <= self.host.num_free_blocks


class Engines:
    """LLM instances by configuration, a few kept alive (oldest shut down first)."""

    def __init__(self, root: str, keep: int = 6) -> None:
        self.root, self.keep, self.llms = root, keep, {}

    def get(self, model: str, **kw: Any) -> LLM:
        kw.setdefault("block_size", 4)
        key = (model, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in self.llms:
            if len(self.llms) >= self.keep:
                self.llms.pop(next(iter(self.llms))).shutdown()
            self.llms[key] = LLM(model=os.path.join(self.root, model), dtype="float32",
                                 device="cpu", **kw)
        return self.llms[key]

    def plain(self, model: str, lora: bool, kv_dtype: str) -> LLM:
        kw: dict[str, Any] = {"num_kv_blocks": 600, "enable_prefix_caching": False,
                              "enforce_eager": True, "kv_cache_dtype": kv_dtype}
        if lora:
            kw.update(enable_lora=True, max_loras=3, max_lora_rank=8)
        return self.get(model, **kw)


def draw_config(rng: random.Random, root: str) -> tuple[str, dict[str, Any], bool]:
    """(model, LLM keyword arguments, whether requests use LoRA): one combination, minus those
    the engine refuses at start-up (draft model with swap or several KV-cache groups, async
    scheduling with speculation or swap, a quantized cache with swap or MLA)."""
    model = rng.choice(["llama"] * 4 + MODELS[2:])
    bs = rng.choice([1, 2, 4, 4, 4, 8, 16])
    kw: dict[str, Any] = {"enable_prefix_caching": rng.random() < 0.7, "block_size": bs}
    budget = rng.choice([None, 16, 24, 32, 64, 1, 2, 3, 5, 8])
    if budget:
        kw["max_num_batched_tokens"] = budget
    kw["num_kv_blocks"] = max(3, rng.randint(56, 120) // bs) if rng.random() < 0.5 \
        else 1600 // bs
    spec = rng.choice([None, None, "ngram", "draft_self", "draft_other"])
    if model in ("qwen2_layer_types", "gemma3") and spec and spec.startswith("draft"):
        spec = "ngram"
    swap = rng.random() < 0.35 and spec in (None, "ngram")
    quant_kv = rng.random() < 0.15 and spec is None and not swap and model != "deepseek_v2"
    if swap:
        kw["preemption_mode"] = "swap"
    k, adaptive = rng.randint(1, 4), rng.random() < 0.3
    if spec == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                    "adaptive": adaptive}
    elif spec:
        draft = "llama_mqa" if spec == "draft_other" and model == "llama" else "llama"
        kw["speculative_config"] = {"method": "draft_model", "quantization": "none",
                                    "model": os.path.join(root, draft),
                                    "num_speculative_tokens": k, "adaptive": adaptive}
    lora = model == "llama" and rng.random() < 0.35
    if lora:
        kw.update(enable_lora=True, max_loras=rng.choice([1, 2, 3]), max_lora_rank=8)
    if rng.random() < 0.3:
        kw["policy"] = "priority"
    if rng.random() < 0.3 and spec is None and not swap:
        kw["async_scheduling"] = True
    kw["enforce_eager"] = rng.random() < 0.5
    if rng.random() < 0.3:
        kw["max_num_seqs"] = rng.randint(1, 4)
    if quant_kv:
        kw["kv_cache_dtype"] = rng.choice(["int8", "fp8"])
    return model, kw, lora


def draw_requests(rng: random.Random, adapters: list[LoRARequest] | None, priority: bool,
                  sampled: bool) -> list[list[Any]]:
    """3-10 requests [prompt ids, SamplingParams kwargs, arrival step, priority, adapter]
    cut from two 64-token bases (shared prefixes of 1-48 tokens)."""
    bases = [[rng.randint(2, 319) for _ in range(64)] for _ in range(2)]
    reqs = []
    for _ in range(rng.randint(3, 10)):
        prompt = rng.choice(bases)[:rng.randint(1, 48)] + \
            [rng.randint(2, 319) for _ in range(rng.randint(0, 12))]
        prompt += [7] * (2 - len(prompt))
        max_tokens = rng.choice([1, 2, 5, 12, 20, 30, 40])
        sp: dict[str, Any] = {"temperature": 0, "max_tokens": max_tokens, "logprobs": 2,
                              "ignore_eos": rng.random() < 0.7, "n": rng.choice([1, 1, 1, 2, 3])}
        if rng.random() < 0.2:
            sp["min_tokens"] = rng.randint(0, max_tokens)
        if rng.random() < 0.15:
            sp["prompt_logprobs"] = rng.randint(0, 2)
        if sampled and rng.random() < 0.4:
            sp.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randint(0, 1000),
                      top_k=rng.choice([0, 5]))
        reqs.append([prompt, sp, rng.choice([0, 0, 0, 1, 3, 6, 10]),
                     rng.randint(-2, 2) if priority else 0,
                     rng.choice([None, *adapters]) if adapters else None])
    return reqs


def run(llm: LLM, reqs: list[Any], abort: tuple[int, int] | None = None) -> list[Any]:
    """Feed ``reqs`` ((prompt, SamplingParams, arrival step, priority, adapter)) step by step;
    ``abort`` = (request index, step) aborts that request there. Returns the finished
    RequestOutputs in order (None for an aborted one)."""
    eng = llm.engine
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    ids: dict[str, int] = {}
    out: dict[int, Any] = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and reqs[pending[0]][2] <= step:
            i = pending.pop(0)
            prompt, params, _, prio, lora = reqs[i]
            ids[eng.add_request(prompt, params, priority=prio, lora_request=lora)] = i
        if abort is not None and step == abort[1] and abort[0] in ids.values():
            eng.abort_request(next(k for k, v in ids.items() if v == abort[0]))
            out[abort[0]] = None
        for o in eng.step():
            if o.finished and out.get(ids[o.request_id], 1) is not None:
                out[ids[o.request_id]] = o
        step += 1
        if step > 5000:
            raise AssertionError("engine stuck: 5000 steps")
    return [out[i] for i in range(len(reqs))]


def _margin(logprobs: dict) -> float:
    v = sorted((x.logprob for x in logprobs.values()), reverse=True)
    return v[0] - v[1] if len(v) > 1 else float("inf")


def _no_near_tie(output: Any) -> bool:
    return all(_margin(lp) >= NEAR_TIE for c in output.outputs for lp in c.logprobs or [])


def compare(ref: list[Any], got: list[Any], quant: bool) -> None:
    """Raise AssertionError where ``got`` differs from the oracle ``ref``."""
    tol = QUANT_TIE if quant else LOGPROB_TOL
    for r, g in zip(ref, got):
        assert len(r.outputs) == len(g.outputs)
        if r.prompt_logprobs is not None or g.prompt_logprobs is not None:
            for la, lb in zip(r.prompt_logprobs, g.prompt_logprobs, strict=True):
                assert (la is None) == (lb is None)
                for t in (la or {}).keys() & (lb or {}).keys():
                    assert abs(la[t].logprob - lb[t].logprob) < tol, ("prompt", la, lb)
        for a, b in zip(r.outputs, g.outputs):
            if a.token_ids != b.token_ids:
                i = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids))
                          if x != y), min(len(a.token_ids), len(b.token_ids)))
                if quant and i < min(len(a.logprobs), len(b.token_ids)) and \
                        _margin(a.logprobs[i]) < QUANT_TIE:
                    continue
                raise AssertionError(f"tokens differ at {i}: {a.token_ids} {a.finish_reason} "
                                     f"vs {b.token_ids} {b.finish_reason}")
            assert (a.text, a.finish_reason) == (b.text, b.finish_reason), (a, b)
            for la, lb, t in zip(a.logprobs or [], b.logprobs or [], a.token_ids):
                assert abs(la[t].logprob - lb[t].logprob) < tol, (la[t], lb[t])


def check_no_leaks(llm: LLM) -> None:
    """Every request gone, every usable block free, no host swap block held."""
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    pool = core.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks, "KV blocks leaked"
    swap = core.scheduler.swap
    if swap is not None:  # host blocks read by the last swap-ins are freed at the next step
        assert not swap.swapped and \
            swap.host.num_free_blocks + len(swap._release_next) == swap.host.num_blocks


def one_case(seed: int, config_seed: int, engines: Engines, adapters: list[LoRARequest]) -> str:
    """Run case ``seed`` (configuration from ``config_seed``); returns a summary line.

    Raises:
        AssertionError: on a divergence from the oracle or a leak.
    """
    rng = random.Random(seed)
    model, kw, lora = draw_config(random.Random(config_seed), engines.root)
    spec = "speculative_config" in kw
    reqs = draw_requests(rng, adapters if lora else None, kw.get("policy") == "priority",
                         sampled=not spec)
    llm = engines.get(model, **kw)
    max_len = llm.engine.core.max_model_len
    for r in reqs:
        if rng.random() < 0.15:  # up to the end of the context
            r[1]["max_tokens"] = max(1, max_len - len(r[0]))
            r[1]["min_tokens"] = min(r[1].get("min_tokens", 0), r[1]["max_tokens"])
    reqs = [r for r in reqs if len(r[0]) + r[1]["max_tokens"] <= max_len]
    kv_dtype = kw.get("kv_cache_dtype", "auto")
    plain = engines.plain(model, lora, kv_dtype)
    first = run(plain, [(p, SamplingParams(**sp), 0, 0, lr) for p, sp, _, _, lr in reqs])
    kept = [(r, o) for r, o in zip(reqs, first) if _no_near_tie(o)]
    if not kept:
        return "skipped (near-ties)"
    add_oracle_stops(kept, rng, p_stop_ids=0.3, min_text=5)
    reqs = [(p, SamplingParams(**sp), arr, prio, lr) for (p, sp, arr, prio, lr), _ in kept]
    ref = run(plain, [(p, sp, 0, 0, lr) for p, sp, _, _, lr in reqs])
    hits0 = llm.engine.core.kv_cache_manager.num_hits
    abort = (rng.randrange(len(reqs)), rng.randint(0, 12)) if rng.random() < 0.2 else None
    got = run(llm, reqs, abort)
    keep = [i for i, g in enumerate(got) if g is not None]
    compare([ref[i] for i in keep], [got[i] for i in keep], kv_dtype != "auto")
    check_no_leaks(llm)
    sched = llm.engine.core.scheduler
    return (f"ok reqs={len(reqs)} hits={llm.engine.core.kv_cache_manager.num_hits - hits0} "
            f"preemptions={sched.num_preemptions} "
            f"swaps={sched.swap.num_swapped_out if sched.swap else 0} "
            f"accepted={sum(g.metrics.num_accepted_tokens for g in got if g)} {model} {kw}")


def add_oracle_stops(pairs: list[tuple[Any, Any]], rng: random.Random, p_stop_ids: float,
                     min_text: int) -> None:
    """Stops the oracle's own output reaches, drawn into each request's sampling kwargs
    (``request[1]``) of ``(request, oracle RequestOutput)`` pairs: with probability
    ``p_stop_ids`` one of its generated token ids after the first, with probability 0.25 (for
    a text of at least ``min_text`` characters) a 1-3 character piece of its text."""
    for r, o in pairs:
        toks, text = o.outputs[0].token_ids, o.outputs[0].text
        if len(toks) > 2 and rng.random() < p_stop_ids:
            r[1]["stop_token_ids"] = [rng.choice(toks[1:])]
        if len(text) >= min_text and rng.random() < 0.25:
            a = rng.randint(1, len(text) - 2)
            r[1]["stop"] = [text[a:a + rng.randint(1, 3)]]


def fuzz_args(description: str, default_n: int) -> argparse.Namespace:
    """The fuzzers' common options (--start, --n, --sticky, --models), parsed; exits with a
    usage error for --n or --sticky below 1."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--start", type=int, default=0, help="first case seed")
    ap.add_argument("--n", type=int, default=default_n, help="number of cases")
    ap.add_argument("--sticky", type=int, default=1,
                    help="consecutive cases sharing one configuration (and engine)")
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "kvflow_combo_fuzz"),
                    help="folder for the tiny models and adapters (built once, reused)")
    args = ap.parse_args()
    if args.n < 1 or args.sticky < 1:
        ap.error("--n and --sticky must be >= 1")
    return args


def run_cases(args: argparse.Namespace, case: Callable[[int, int], str]) -> int:
    """Run ``case(seed, config_seed)`` for each seed (``config_seed``: the seed of the
    configuration, shared by ``--sticky`` consecutive cases), printing one line per case
    (a failure's exception and traceback, then the next case); returns the exit status,
    1 if any case failed."""
    failed = 0
    for seed in range(args.start, args.start + args.n):
        t0 = time.perf_counter()
        try:
            line = case(seed, seed // args.sticky)
        except Exception as e:  # noqa: BLE001 - report the case and go on
            failed += 1
            line = f"FAIL {e!r}"[:2000]
            traceback.print_exc(limit=6)
        print(f"{seed} {time.perf_counter() - t0:.1f}s {line}", flush=True)
    print(f"{args.n} cases, {failed} failed")
    return 1 if failed else 0


def main() -> int:
    args = fuzz_args(__doc__.split("\n")[0], 200)
    kv_swap.SwapManager.should_swap = _always_swap
    adapters = build_models(args.models)
    engines = Engines(args.models)
    return run_cases(args, lambda seed, config: one_case(seed, config, engines, adapters))


if __name__ == "__main__":
    sys.exit(main())
