"""End-to-end check of ``kvflow serve --data-parallel-size 2`` on the suite's tiny random Llama
(CPU): what the test suite's one data-parallel server (tests/e2e/test_data_parallel.py) does not
reach, because it needs concurrency and timing. A correctness check, not a timing; about a
minute on 2 busy cores.

    PYTHONPATH=. .venv/bin/python benchmarks/dp_serve_check.py [--out out/dp_check]

Checks (exit status 1 and the failed ones named when any fails):

* balance: 16 concurrent requests with distinct prompts (no shared prefix) split between the
  replicas by *depth*, the unfinished samples each was sent (``engine/dp_balancer.py``); the
  measure printed is each replica's share of the prompt tokens it was sent (its
  ``kvflow:prefix_cache_queries_total`` growth), which must lie in 25-75 %. Requests sent one
  after another to idle replicas all go to replica 0 (equal depth, equal KV use: the lowest
  index), as documented; that is printed, not checked;
* ids: the 16 responses' ``id`` values are distinct, and so are those of concurrent ``n=2``
  requests;
* abort: a long stream whose prompt starts like one replica 1 served (so affinity puts it
  there) is dropped by the client after 3 chunks while a long stream runs on replica 0:
  replica 1's running count reaches 0 within 2 s, and before replica 0's 200-token stream
  ends although replica 1's started 0.5 s later with the same work (the abort reached it;
  it did not run to its end) while replica 0's stream goes on to its 200th token (``length``), and
  ``finished_reason="abort"`` grows by 1;
* metrics: ``kvflow:request_success_total`` (all reasons; it counts samples, so an ``n=2``
  request counts 2) grows by exactly the samples sent, ``kvflow:prompt_tokens_total`` by the
  requests' prompt tokens (hand count), across both replicas;
* bad input: an out-of-vocabulary prompt id and a ``max_tokens`` past the context are 400s with
  an OpenAI error body while both replicas are busy, and no KV block is held at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import start_server, stop_server, wait_ready
from tiny_cases import build_model

A = list(range(100, 120))  # 5 blocks of 4: the first 4 name a replica (affinity)
B = list(range(140, 160))


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                      if k != "model_name")))] = s.value
    return out


def total(m: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` carrying ``labels`` (over replicas and reasons)."""
    wanted = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and wanted <= set(lab))


def per_engine(url: str, name: str) -> dict[str, float]:
    m = metrics(url)
    return {e: total(m, name, engine=e) for e in ("0", "1")}


def complete(url: str, prompt, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=300, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra})


def check_balance_and_ids(url: str, sent: list[tuple[int, int]]) -> dict:
    """16 concurrent distinct prompts, then 4 concurrent n=2 requests; ``sent`` gets each
    request's (prompt tokens, samples)."""
    prompts = [[(7 * i + k) % 300 + 2 for k in range(9)] for i in range(16)]
    before = per_engine(url, "kvflow:prefix_cache_queries_total")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda p: complete(url, p, max_tokens=16), prompts))
        pairs = list(pool.map(lambda i: complete(url, [3, 4, 5, i], n=2), range(4)))
    sent += [(9, 1)] * 16 + [(4, 2)] * 4
    after = per_engine(url, "kvflow:prefix_cache_queries_total")
    share = {e: (after[e] - before[e]) / (9 * 16 + 2 * 4 * 4) for e in after}
    ids = [r.json()["id"] for r in replies + pairs]
    return {"share": share, "ok_status": all(r.status_code == 200 for r in replies + pairs),
            "balanced": all(0.25 <= s <= 0.75 for s in share.values()),
            "ids_distinct": len(set(ids)) == len(ids)}


def sequential_placement(url: str, sent: list[tuple[int, int]]) -> dict[str, float]:
    """Four requests one after another: prompt tokens each replica got."""
    before = per_engine(url, "kvflow:prefix_cache_queries_total")
    for i in range(4):
        complete(url, [9, 8, 7, i])
    sent += [(4, 1)] * 4
    after = per_engine(url, "kvflow:prefix_cache_queries_total")
    return {e: after[e] - before[e] for e in after}


def _stream(url: str, prompt: list[int], stop_after: int | None) -> tuple[int, str | None]:
    """(tokens, finish reason) of one long stream; the client leaves after ``stop_after``
    chunks."""
    chunks, tokens, reason = 0, 0, None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True,
            "return_token_ids": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                tokens += len(choice.get("token_ids") or [])
                reason = choice.get("finish_reason") or reason
                chunks += 1
                if chunks == stop_after:
                    break
    return tokens, reason


def check_abort_and_bad_input(url: str, sent: list[tuple[int, int]]) -> dict:
    """A and B placed on replicas 0 and 1, then long streams on both; replica 1's client
    leaves; bad inputs meanwhile."""
    complete(url, [[*A, 1], [*B, 1]], max_tokens=2)  # one request: A -> 0, B -> 1
    sent += [(21, 1), (21, 1)]
    aborts = total(metrics(url), "kvflow:request_success_total", finished_reason="abort")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t0 = time.monotonic()
        on_zero = pool.submit(_stream, url, [*A, 50], None)
        time.sleep(0.5)
        dropped = pool.submit(_stream, url, [*B, 50], 3)
        dropped.result()
        left, deadline = time.monotonic(), time.monotonic() + 2
        running = per_engine(url, "kvflow:num_requests_running")
        while running["1"] > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
            running = per_engine(url, "kvflow:num_requests_running")
        abort_seen_s, one_stopped_s = time.monotonic() - left, time.monotonic() - t0
        zero_busy = int(per_engine(url, "kvflow:num_requests_running")["0"])
        bad = [complete(url, [10**6]), complete(url, [5, 6], max_tokens=10**4)]
        zero_tokens, zero_reason = on_zero.result()
        zero_s = time.monotonic() - t0
    sent += [(21, 1), (21, 1)]
    m = metrics(url)
    return {"abort_reached_replica_1": running["1"] == 0 and one_stopped_s < zero_s,
            "abort_seen_s": round(abort_seen_s, 2), "replica_0_stream_s": round(zero_s, 2),
            "replica_0_running_then": zero_busy, "replica_0_tokens": zero_tokens,
            "replica_0_finished": (zero_tokens, zero_reason) == (200, "length"),
            "abort_counted": total(m, "kvflow:request_success_total",
                                   finished_reason="abort") == aborts + 1,
            "bad_input_400": [r.status_code for r in bad] == [400, 400]
            and all("error" in r.json() for r in bad)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/dp_check")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(tempfile.mkdtemp(prefix="kvflow-dp-"))
    proc, url = start_server([model, "--dtype", "float32", "--device", "cpu", "--num-kv-blocks",
                              "128", "--block-size", "4", "--max-num-seqs", "8",
                              "--data-parallel-size", "2"], out / "server.log")
    try:
        wait_ready(proc, url)
        start = metrics(url)
        sent: list[tuple[int, int]] = []
        result = {"sequential_prompt_tokens": sequential_placement(url, sent)}
        result.update(check_balance_and_ids(url, sent))
        result.update(check_abort_and_bad_input(url, sent))
        time.sleep(0.5)
        end = metrics(url)
        counted = total(end, "kvflow:request_success_total") - total(
            start, "kvflow:request_success_total")
        result["samples_sent_counted"] = [sum(n for _, n in sent), counted]
        result["samples_counted"] = counted == sum(n for _, n in sent)
        result["prompt_tokens_counted"] = total(end, "kvflow:prompt_tokens_total") - total(
            start, "kvflow:prompt_tokens_total") == sum(t for t, _ in sent)
        result["no_kv_held"] = total(end, "kvflow:kv_cache_free_blocks") == total(
            end, "kvflow:kv_cache_usable_blocks")
    finally:
        stop_server(proc)
    print(json.dumps(result, indent=1))
    failed = [k for k, v in result.items() if v is False]
    if failed:
        print("FAILED:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
