"""``kvflow serve`` with an engine core that is alive but does not run (SIGSTOP: frozen), on the
tiny Llama, with ``--engine-heartbeat-timeout 2`` and ``--engine-failure restart``.

Was: nothing noticed a frozen core: its streams hung for ever, /health answered 200 and the
data-parallel balancer kept sending it requests. Now, within the timeout (plus a check period):

* data parallelism: the frozen replica's stream ends with an ``engine_dead`` error event then
  ``[DONE]``, naming it and its silence; the other replica's stream finishes, /health stays
  200, new requests are served, and ``kvflow:engine_cores_lost{reason="unresponsive"}`` counts
  it; the frozen process is killed and the replica restarted;
* one core: /health answers 503 (``engine_dead``) until a restarted core is ready.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ready_side_by_side
from tests.e2e.test_data_parallel import replica_pids
from tests.e2e.test_engine_faults import core_pid, wait_for

ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "96", "--block-size", "4",
        "--max-num-seqs", "4", "--uvicorn-log-level", "info", "--engine-failure", "restart",
        "--engine-heartbeat-timeout", "2"]
DP_ARGS = [*ARGS, "--data-parallel-size", "2"]
LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), DP_ARGS, None),
            (fixture("tiny_chat_model"), ARGS, None)]


@pytest.fixture(scope="module")
def servers(start_server, request):
    started = {"dp": start_server.declared(request, 0, wait=False),
               "one": start_server.declared(request, 1, wait=False)}
    with ready_side_by_side(*started.values()):
        yield started


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (reaped, or a zombie: killed, not yet waited for)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _stream(server, rank: str, freeze: int | None = None) -> list[dict]:
    """The events of one long stream pinned to replica ``rank``; after its first chunk,
    SIGSTOP the process ``freeze`` (None: none)."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, timeout=60,
                      headers={"X-data-parallel-rank": rank}) as resp:
        for line in (x for x in resp.iter_lines() if x.startswith("data: ")):
            events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
            if freeze is not None and len(events) == 1:
                os.kill(freeze, signal.SIGSTOP)
    return events


def test_a_frozen_replica_fails_its_stream_and_the_other_serves(servers):
    server = servers["dp"]
    old = replica_pids(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        on_zero = pool.submit(_stream, server, "0")
        on_one = _stream(server, "1", freeze=old[1])  # bounded by httpx's 60 s (was: hung)
        on_zero = on_zero.result()
    assert on_one[-1] == {"done": True} and on_one[-2]["error"]["code"] == "engine_dead"
    message = on_one[-2]["error"]["message"]
    assert "engine core 1 of 2 (pid" in message
    assert "sent no heartbeat and used no CPU for" in message
    assert "the process is stopped (SIGSTOP or SIGTSTP)" in message
    assert on_zero[-2]["choices"][0]["finish_reason"] == "length"  # all 200 tokens
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": [9, 10], "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    m = server.metrics()
    assert server.value(m, "kvflow:engine_cores_lost_total", engine="1",
                        reason="unresponsive") == 1
    assert server.value(m, "kvflow:engine_cores_lost_total", engine="0") == 0
    assert "sent no heartbeat" in server.log()
    wait_for(lambda: _gone(old[1]), timeout=10)  # killed (then restarted: not waited for)
    assert not _gone(old[0])


def test_a_frozen_single_core_makes_health_503(servers):
    server = servers["one"]
    os.kill(core_pid(server.proc.pid), signal.SIGSTOP)
    health = wait_for(lambda: _unhealthy(server), timeout=10, step=0.05)
    assert health.json()["error"]["code"] == "engine_dead"
    assert "sent no heartbeat" in server.log()  # (its restart is not waited for)


def _unhealthy(server) -> httpx.Response | None:
    health = httpx.get(f"{server.url}/health", timeout=5)
    return health if health.status_code == 503 else None
