"""Serving-benchmark metric math: pure functions over client-side timestamps.

Definitions (the ones vLLM's and SGLang's serving benchmarks use):
- TTFT: time from sending a request to receiving its first generated token (seconds).
- ITL: every gap between two successive token-carrying stream chunks of one request.
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1): the mean time per output token after
  the first; undefined for a request with a single output token.
- E2E: time from sending a request to receiving its last token-carrying chunk (the trailing
  usage chunk and ``[DONE]`` carry no token; vLLM's ``latency``).
- Goodput: completed requests per second that meet every given SLO (Zhong et al., DistServe,
  OSDI 2024).
- Peak output throughput and peak concurrency: vLLM's ``max_output_tokens_per_s`` and
  ``max_concurrent_requests``, from one-second buckets since the first send (see
  :func:`peak_per_second`).
Percentiles interpolate linearly between closest ranks (numpy's default "linear" method).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

# SLO names accepted by ``--goodput`` -> RequestTiming attribute (seconds)
SLO_KEYS = ("ttft", "tpot", "e2e")
# vLLM's name for the end-to-end SLO (``vllm bench serve --goodput e2el:MS``)
SLO_ALIASES = {"e2el": "e2e"}


@dataclass(frozen=True)
class RequestTiming:
    """Latencies of one completed request, in seconds.

    Attributes:
        ttft: time to first token.
        tpot: mean time per output token after the first (None with fewer than 2 tokens).
        e2e: end-to-end latency.
        itls: inter-token latencies, one per gap between token-carrying chunks.
    """

    ttft: float
    tpot: float | None
    e2e: float
    itls: tuple[float, ...]


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values``, interpolating linearly between the two
    closest ranks (numpy ``method="linear"``). NaN for an empty sequence.

    Raises:
        ValueError: if ``p`` is outside [0, 100].
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside [0, 100]")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, std, median, p90, p99, min and max of ``values`` multiplied by ``scale`` (e.g. 1e3
    for seconds -> milliseconds); NaN entries for an empty sequence. ``std`` is the population
    standard deviation (divisor n, numpy's ``np.std`` default, as vLLM's ``std_*_ms``)."""
    scaled = [v * scale for v in values]
    mean = sum(scaled) / len(scaled) if scaled else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in scaled) / len(scaled)) if scaled else math.nan
    return {"mean": mean, "std": std, "median": percentile(scaled, 50),
            "p90": percentile(scaled, 90), "p99": percentile(scaled, 99),
            "min": min(scaled, default=math.nan), "max": max(scaled, default=math.nan)}


def request_timing(start: float, token_times: Sequence[float],
                   num_output_tokens: int) -> RequestTiming:
    """Latencies of one request from client timestamps (seconds, one clock).

    Args:
        start: when the request was sent.
        token_times: arrival time of every chunk that carried generated tokens, in order; the
            last one ends the request (E2E), as in vLLM's benchmark.
        num_output_tokens: tokens generated (from the server's usage, else the tokenizer); a
            chunk may carry several tokens, so this can exceed ``len(token_times)``.

    Raises:
        ValueError: if no token chunk arrived.
    """
    if not token_times:
        raise ValueError("no token arrived: TTFT is undefined")
    ttft = token_times[0] - start
    e2e = token_times[-1] - start
    itls = tuple(b - a for a, b in itertools.pairwise(token_times))
    tpot = (e2e - ttft) / (num_output_tokens - 1) if num_output_tokens > 1 else None
    return RequestTiming(ttft=ttft, tpot=tpot, e2e=e2e, itls=itls)


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (milliseconds in,
    seconds out). ``e2el`` (vLLM's name) is taken for ``e2e``.

    Raises:
        ValueError: for an unknown SLO name, a missing colon, a non-positive value or an SLO
            given twice.
    """
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        name = SLO_ALIASES.get(name, name)
        if name in slos:
            raise ValueError(f"bad --goodput entry {spec!r}: the {name} SLO is given twice")
        if not sep or name not in SLO_KEYS:
            raise ValueError(f"bad --goodput entry {spec!r}: use NAME:MS with NAME one of "
                             f"{', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not 0 < ms < math.inf:
            raise ValueError(f"bad --goodput entry {spec!r}: the SLO must be a number of "
                             f"milliseconds > 0")
        slos[name] = ms / 1e3
    return slos


def meets_slos(timing: RequestTiming, slos: dict[str, float]) -> bool:
    """True when every SLO (seconds) holds; a request without a TPOT (one output token)
    meets any TPOT SLO."""
    for name, limit in slos.items():
        value = getattr(timing, name)
        if value is not None and value > limit:
            return False
    return True


def goodput(timings: Sequence[RequestTiming], slos: dict[str, float],
            duration_s: float) -> tuple[int, float]:
    """(number of requests meeting every SLO, those requests per second of ``duration_s``)."""
    good = sum(1 for t in timings if meets_slos(t, slos))
    return good, good / duration_s if duration_s > 0 else math.nan


def peak_per_second(starts: Sequence[float],
                    token_times: Sequence[Sequence[float]]) -> tuple[float, int]:
    """vLLM's ``(max_output_tokens_per_s, max_concurrent_requests)`` of completed requests
    (``calculate_metrics`` in vllm/benchmarks/serve.py), from client timestamps in seconds.

    Time is cut into one-second buckets from the earliest send: ``int(t - first_start)``, for
    ``ceil(last_token - first_start) + 1`` buckets. The first is the most token-carrying chunks
    in one bucket (each chunk counts one, as in vLLM, even one carrying several tokens), the
    second the most requests active in one bucket (a request is active in every bucket from
    its send's to its last token chunk's, both included: active at some time in that second,
    not necessarily at once, so it can exceed ``--max-concurrency``). ``(0.0, 0)`` without
    requests.

    Args:
        starts: when each request was sent.
        token_times: each request's token-chunk arrival times (non-empty), in order.
    """
    if not starts:
        return 0.0, 0
    first = min(starts)
    num_buckets = math.ceil(max(times[-1] for times in token_times) - first) + 1
    tokens, active = [0] * num_buckets, [0] * num_buckets
    for start, times in zip(starts, token_times):
        for t in times:
            tokens[int(t - first)] += 1
        for bucket in range(int(start - first), int(times[-1] - first) + 1):
            active[bucket] += 1
    return float(max(tokens)), max(active)
