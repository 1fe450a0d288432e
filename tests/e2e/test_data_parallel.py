"""``kvflow serve --data-parallel-size 2`` on the tiny Llama: two engine-core processes behind
one API server.

* greedy tokens equal the one-process engine's (itself checked against HF transformers) and
  both replicas serve (their own ``engine`` series in /metrics);
* a prompt that shares its first blocks with an earlier one goes to that one's replica (its
  prefix-cache hits grow there), even when another replica is as idle;
* vLLM's ``X-data-parallel-rank`` header pins a request to its replica (a bad one is a 400);
* /metrics counts every replica's requests (the server-wide counters grow by what was sent)
  and a bad prompt is a 400 on a data-parallel server too;
* with ``--engine-failure restart`` a killed replica fails only its own stream, the other
  replica keeps streaming and takes new requests, and the dead one comes back.

The ``--engine-failure exit`` case (the server stops, every stream ends with an error) is in
the slow set (``scripts/test_distributed_slow.sh``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal

import httpx
import pytest

from tests.distributed.conftest import PROMPTS, assert_same_greedy, greedy_run
from tests.e2e.test_engine_faults import wait_for

ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "96", "--block-size", "4",
        "--max-num-seqs", "4", "--uvicorn-log-level", "info", "--data-parallel-size", "2"]
SERVER_ARGS = [*ARGS, "--engine-failure", "restart"]
LONG = {"max_tokens": 200, "ignore_eos": True, "stream": True}


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), SERVER_ARGS, None)]


def replica_pids(server) -> dict[int, int]:
    """Replica index -> pid of its latest core process (from the server's log)."""
    found = re.findall(r"engine core (\d+) of \d+ ready \(pid (\d+)\)",
                       server.log_path.read_text(errors="replace"))
    return {int(index): int(pid) for index, pid in found}


def per_engine(server, name: str) -> dict[str, float]:
    m = server.metrics()
    return {e: server.value(m, name, engine=e) for e in ("0", "1")}


def complete(server, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_greedy_tokens_equal_one_process_and_both_replicas_serve(server, tiny_chat_model):
    reference, _ = greedy_run(tiny_chat_model)
    before = per_engine(server, "kvflow:prefix_cache_queries_total")
    # one request of 4 prompts: queued at once, so they alternate between the replicas
    resp = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": PROMPTS, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert_same_greedy(reference, [[(t, None) for t in c["token_ids"]] for c in choices])
    after = per_engine(server, "kvflow:prefix_cache_queries_total")
    assert all(after[e] > before[e] for e in ("0", "1")), (before, after)
    m = server.metrics()
    for e in ("0", "1"):  # each replica has its own idle pool again
        assert server.value(m, "kvflow:kv_cache_free_blocks", engine=e) == 95


A = list(range(100, 120))  # 5 blocks of 4 token ids; the first 4 blocks name the replica
B = list(range(140, 160))


def test_a_shared_prefix_goes_back_to_its_replica(server):
    """One request of two prompts queues both at once: A goes to replica 0, B to replica 1
    (the least loaded then). Later, with both replicas idle, the least-loaded rule alone
    would send everything to replica 0; prompts starting like B go to replica 1."""
    wait_for(lambda: per_engine(server, "kvflow:num_requests_running") == {"0": 0, "1": 0})
    resp = httpx.post(f"{server.url}/v1/completions", timeout=120,
                      json={"prompt": [[*A, 1, 2], [*B, 1, 2]], "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    for tail, engine in (([3, 4, 5], "1"), ([6], "1"), ([7, 8], "1")):
        hits = per_engine(server, "kvflow:prefix_cache_hits_total")
        complete(server, [*B, *tail])
        grew = {e: v - hits[e] for e, v in per_engine(
            server, "kvflow:prefix_cache_hits_total").items()}
        assert grew == {"0": 0, engine: 20}  # the 5 shared blocks, cached on replica 1
    hits = per_engine(server, "kvflow:prefix_cache_hits_total")
    complete(server, [*A, 9])
    assert per_engine(server, "kvflow:prefix_cache_hits_total") == {
        "0": hits["0"] + 20, "1": hits["1"]}


def test_metrics_sum_the_replicas_and_bad_input_is_a_400(server):
    """One request of three prompts (A's on replica 0, B's on replica 1 by affinity): the
    server-wide counters grow by what was sent (3 requests, 21 + 21 + 3 prompt tokens, 3 x 3
    generated), and the per-replica prefix-cache queries add up to the prompt tokens, both
    replicas taking part. A prompt id outside the vocabulary is a 400 with an OpenAI error
    body, and the replicas keep serving."""
    before = server.metrics()
    queries = per_engine(server, "kvflow:prefix_cache_queries_total")
    resp = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": [[*A, 1], [*B, 1], [7, 8, 9]], "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    after = server.metrics()

    def grew(name: str, **labels: str) -> float:
        return server.value(after, name, **labels) - server.value(before, name, **labels)

    assert grew("kvflow:request_success_total", finished_reason="length") == 3
    assert grew("kvflow:prompt_tokens_total") == 45
    assert grew("kvflow:generation_tokens_total") == 9
    more = {e: v - queries[e] for e, v in per_engine(
        server, "kvflow:prefix_cache_queries_total").items()}
    assert sum(more.values()) == 45 and min(more.values()) >= 21, more
    bad = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json={"prompt": [10**6], "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt.0"
    assert len(complete(server, [5, 6, 7], max_tokens=2)["token_ids"]) == 2


def test_the_data_parallel_rank_header_pins_the_replica(server):
    """vLLM's ``X-data-parallel-rank`` header sends a request to that replica, whatever the
    balancer would choose: with both idle it would take replica 0 (lowest index), and then the
    replica holding the prompt's prefix. Each replica's prefix-cache queries grow by the
    prompt's 12 tokens where it ran, and only there. A rank outside [0, 2) or not an integer
    is a 400 naming the header (was: the header was ignored)."""
    prompt = list(range(200, 212))
    for rank in ("1", "0", "1"):
        wait_for(lambda: per_engine(server, "kvflow:num_requests_running") == {"0": 0, "1": 0})
        before = per_engine(server, "kvflow:prefix_cache_queries_total")
        resp = httpx.post(f"{server.url}/v1/completions", timeout=120,
                          headers={"X-data-parallel-rank": rank},
                          json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        grew = {e: v - before[e] for e, v in per_engine(
            server, "kvflow:prefix_cache_queries_total").items()}
        assert grew == {"0": 0, "1": 0, rank: 12}, (rank, grew)
    before = per_engine(server, "kvflow:prefix_cache_queries_total")
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                      headers={"X-data-parallel-rank": "1"},
                      json={"messages": [{"role": "user", "content": "the quick fox"}],
                            "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    after = per_engine(server, "kvflow:prefix_cache_queries_total")
    assert after["0"] == before["0"] and after["1"] > before["1"]
    for bad in ("2", "-1", "one"):
        resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          headers={"X-data-parallel-rank": bad},
                          json={"prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 400, (bad, resp.text)
        assert resp.json()["error"]["param"] == "X-data-parallel-rank"


def _stream(server, prompt: list[int], kill_after: int | None = None) -> list[dict]:
    """The events of one long stream; after ``kill_after`` chunks SIGKILL replica 1."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": prompt, **LONG},
                      timeout=120) as resp:
        for i, line in enumerate(x for x in resp.iter_lines() if x.startswith("data: ")):
            events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
            if i + 1 == kill_after:
                os.kill(replica_pids(server)[1], signal.SIGKILL)
    return events


def _kill_replica_one_mid_stream(server) -> tuple[list[dict], list[dict]]:
    """Streams on both replicas (their prompts start like A, known on replica 0, and B, known
    on replica 1: affinity places them whatever the timing); replica 1 is killed after the
    first chunk of its stream (the earliest point: on a busy machine a reader three chunks in
    found the 200 tokens already sent, the stream whole). Returns (replica 0's events, replica 1's events)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        on_zero = pool.submit(_stream, server, [*A, 50])
        on_one = _stream(server, [*B, 50], kill_after=1)
        return on_zero.result(), on_one


def assert_ends_with_engine_dead(events: list[dict]) -> None:
    assert events[-1] == {"done": True} and events[-2]["error"]["code"] == "engine_dead"
    assert "engine core 1 of 2" in events[-2]["error"]["message"]


def test_a_killed_replica_fails_only_its_requests_and_restarts(server):
    old = replica_pids(server)
    on_zero, on_one = _kill_replica_one_mid_stream(server)
    # replica 0 still serves meanwhile: health and new requests
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert len(complete(server, [5, 6, 7], max_tokens=3)["token_ids"]) == 3
    assert_ends_with_engine_dead(on_one)
    assert on_zero[-1] == {"done": True} and all("error" not in e for e in on_zero)
    assert on_zero[-2]["choices"][0]["finish_reason"] == "length"  # all 200 tokens
    wait_for(lambda: replica_pids(server)[1] != old[1] and
             per_engine(server, "kvflow:kv_cache_free_blocks") == {"0": 95, "1": 95})
    assert replica_pids(server)[0] == old[0]  # replica 0 was never restarted
    assert "engine core restarted" in server.log()
    # the new replica 1 serves (its prefix cache starts empty)
    hits = per_engine(server, "kvflow:prefix_cache_hits_total")
    resp = httpx.post(f"{server.url}/v1/completions", timeout=120,
                      json={"prompt": [[*A, 1], [*B, 1]], "max_tokens": 2})
    assert resp.status_code == 200
    assert per_engine(server, "kvflow:prefix_cache_hits_total")["0"] == hits["0"] + 20


@pytest.mark.distributed_slow
@pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                    reason="slow: run scripts/test_distributed_slow.sh")
def test_a_killed_replica_stops_the_server_under_exit(start_server, tiny_chat_model):
    server = start_server(tiny_chat_model, ARGS)
    resp = httpx.post(f"{server.url}/v1/completions", timeout=120,
                      json={"prompt": [[*A, 1, 2], [*B, 1, 2]], "max_tokens": 4})
    assert resp.status_code == 200
    _, on_one = _kill_replica_one_mid_stream(server)
    assert_ends_with_engine_dead(on_one)
    assert server.proc.wait(30) == 1
    assert "shutting the server down" in server.log()
