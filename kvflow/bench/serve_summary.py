"""The summary of a ``kvflow bench serve`` run: token counts, latency statistics, goodput,
failures by kind, the printed table and the JSON-safe form of the result."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

from kvflow.bench import metrics
from kvflow.bench.client import RequestResult
from kvflow.bench.datasets import BenchRequest

MAX_ERRORS_KEPT = 20
# Series whose result keys are also written under vLLM's name (``vllm bench serve`` writes
# ``mean_e2el_ms``, ``median_e2el_ms``, ``std_e2el_ms``, ``p99_e2el_ms``; kvflow's scripts
# read the ``*_e2e_ms`` keys).
VLLM_KEY_NAMES = MappingProxyType({"e2e": "e2el"})


def _token_counts(req: BenchRequest, res: RequestResult, tokenizer_factory) -> tuple[int, int]:
    """(prompt tokens, output tokens): the server's usage, else the tokenizer, else the
    dataset's prompt length and the number of token chunks."""
    prompt, output = res.prompt_tokens, res.completion_tokens
    if output is None or prompt is None:
        tok = tokenizer_factory()
        if output is None:
            output = (len(tok.encode(res.text, add_special_tokens=False)) if tok is not None
                      else len(res.token_times))
        if prompt is None:
            prompt = req.prompt_len
            if tok is not None and isinstance(req.prompt, str):
                prompt = len(tok.encode(req.prompt))
    return prompt, output


def aggregate(requests: list[BenchRequest], results: list[RequestResult], duration: float,
              slos: dict[str, float], tokenizer_factory) -> dict[str, Any]:
    """The benchmark summary (flat keys as in vLLM's serving benchmark; latencies in ms,
    throughputs per second) plus per-request lists."""
    timings, in_lens, out_lens, usage_ok, errors = [], [], [], 0, []
    for req, res in zip(requests, results):
        if not res.success:
            errors.append(res.error)
            continue
        prompt_len, out_len = _token_counts(req, res, tokenizer_factory)
        usage_ok += res.completion_tokens is not None
        in_lens.append(prompt_len)
        out_lens.append(out_len)
        timings.append(metrics.request_timing(res.start, res.token_times, out_len))
    out = {"duration": duration, "completed": len(timings), "failed": len(errors),
           "failed_by_kind": error_kinds(errors), "usage_from_server": usage_ok, "total_input_tokens": sum(in_lens),
           "total_output_tokens": sum(out_lens),
           "request_throughput": len(timings) / duration,
           "output_throughput": sum(out_lens) / duration,
           "total_token_throughput": (sum(in_lens) + sum(out_lens)) / duration}
    series = {"ttft": [t.ttft for t in timings], "e2e": [t.e2e for t in timings],
              "tpot": [t.tpot for t in timings if t.tpot is not None],
              "itl": [gap for t in timings for gap in t.itls]}
    for name, values in series.items():
        for stat, value in metrics.summarize(values, scale=1e3).items():
            out[f"{stat}_{name}_ms"] = value
            if name in VLLM_KEY_NAMES:  # vLLM's key too, for scripts that parse its results
                out[f"{stat}_{VLLM_KEY_NAMES[name]}_ms"] = value
    out["request_goodput"] = None  # vLLM's value without --goodput
    if slos:
        out["goodput_slos_ms"] = {k: v * 1e3 for k, v in slos.items()}
        out["good_requests"], out["request_goodput"] = metrics.goodput(timings, slos, duration)
    done = [res for res in results if res.success]
    out["max_output_tokens_per_s"], out["max_concurrent_requests"] = metrics.peak_per_second(
        [res.start for res in done], [res.token_times for res in done])
    out.update(input_lens=in_lens, output_lens=out_lens, ttfts=series["ttft"],
               latencies=series["e2e"],  # vLLM's per-request E2E list (seconds)
               start_times=[res.start for res in done],  # vLLM's (time.perf_counter, s)
               itls=[list(t.itls) for t in timings], errors=errors[:MAX_ERRORS_KEPT])
    return out


def error_kinds(errors: list[str]) -> dict[str, int]:
    """Failures counted by kind: the text before the first colon of each error
    (``HTTP 503``, ``TimeoutError``, ``error event in stream``, ...)."""
    kinds: dict[str, int] = {}
    for error in errors:
        kind = error.split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def print_summary(r: dict[str, Any]) -> None:
    """The human-readable table of one run."""
    rows = [("Request rate (req/s)", r["request_rate"]),
            ("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
            ("Benchmark duration (s)", r["duration"]),
            ("Total input tokens", r["total_input_tokens"]),
            ("Total generated tokens", r["total_output_tokens"]),
            ("Request throughput (req/s)", r["request_throughput"]),
            ("Output token throughput (tok/s)", r["output_throughput"]),
            ("Total token throughput (tok/s)", r["total_token_throughput"])]
    if r.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", r["request_goodput"]))
    rows += [("Peak output token throughput (tok/s)", r["max_output_tokens_per_s"]),
             ("Peak concurrent requests", r["max_concurrent_requests"])]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        rows += [(f"{stat.capitalize()} {title} (ms)", r[f"{stat}_{name}_ms"])
                 for stat in ("mean", "median", "p90", "p99")]
    print(f"{' ' + r['label'] + ' ':=^52}")
    for name, value in rows:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{name:<40}{shown:>12}")
    _print_errors(r)


def _print_errors(r: dict[str, Any]) -> None:
    if not r["failed"]:
        return
    print(f"{r['failed']} request(s) failed; distinct errors:")
    for err in dict.fromkeys(r["errors"]):
        print(f"  {err}")


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON has no NaN: a statistic
    of no values, e.g. the TPOT of one-token outputs, is written as null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
