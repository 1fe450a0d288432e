"""Faults on the tiny Llama: the engine-core process killed (SIGKILL) mid-stream, and storms of
client disconnects. Killed core: the open stream ends with an error event and ``[DONE]``, new
requests get 503 (``engine_dead``), and the server either exits with status 1 and a log line
saying why (``--engine-failure exit``, the default) or starts a new core and serves again
(``restart``). Disconnects: whatever the moment a client hangs up (queued, prefilling,
streaming, waiting for a whole reply), /metrics shows every KV block free afterwards.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ready_side_by_side

ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "96", "--block-size", "4",
        "--max-num-seqs", "4", "--uvicorn-log-level", "info"]
RESTART_ARGS = [*ARGS, "--engine-failure", "restart"]
LONG = {"prompt": "the quick brown fox", "max_tokens": 200, "ignore_eos": True}
# the exiting server's core is spawned from the start (the variable), the restarting one's
# forked (kvflow serve's default) until its restart
SPAWN_ENV = {"KVFLOW_WORKER_MULTIPROC_METHOD": "spawn"}


def core_pid(server_pid: int) -> int:
    """The engine-core process: the server's child named ``kvflow-core`` (``comm``; forked at
    the first start, spawned on a restart: kvflow/engine/start_method.py)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            comm = (stat.parent / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and comm == "kvflow-core":
            return int(stat.parent.name)
    raise AssertionError("no engine-core process found")


def cmdline(pid: int) -> bytes:
    """``/proc/<pid>/cmdline`` (arguments separated by NUL bytes)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def wait_for(predicate, timeout: float = 60.0, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not met in time")


def stream_then_kill(server) -> list[dict]:
    """Open a stream, kill the core after 3 chunks; returns the events that followed."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(lines)
        os.kill(core_pid(server.proc.pid), signal.SIGKILL)
        for line in lines:
            events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def assert_ends_with_error_event(events: list[dict]) -> None:
    assert events[-1] == {"done": True}
    assert "error" in events[-2], events[-3:]
    assert events[-2]["error"]["code"] == "engine_dead"
    assert all("error" not in e for e in events[:-2])  # tokens, then one error event


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, SPAWN_ENV),
            (fixture("tiny_chat_model"), RESTART_ARGS, None)]


@pytest.fixture(scope="module")
def servers(start_server, request):
    """{"exiting": a server with the default --engine-failure (its core spawned:
    ``SPAWN_ENV``), "restarting": one with ``--engine-failure restart``}, started side by
    side."""
    started = {"exiting": start_server.declared(request, 0, wait=False),
               "restarting": start_server.declared(request, 1, wait=False)}
    with ready_side_by_side(*started.values()):
        yield started


def test_killed_core_exits_the_server(servers):
    server = servers["exiting"]
    assert b"multiprocessing.spawn" in cmdline(core_pid(server.proc.pid))  # SPAWN_ENV
    assert_ends_with_error_event(stream_then_kill(server))
    assert server.proc.wait(30) == 1
    log = server.log()
    assert "engine core died" in log and "shutting the server down" in log


@pytest.fixture(scope="module")
def restarting(servers):
    return servers["restarting"]


def test_killed_core_restarts_with_the_flag(restarting):
    server = restarting
    old_pid = core_pid(server.proc.pid)
    # the first core was forked from the server process (its command line), a restart spawns
    assert cmdline(old_pid) == cmdline(server.proc.pid)
    assert_ends_with_error_event(stream_then_kill(server))
    refused = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 200)
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,  # sampled: ignore EOS
                      json={"prompt": "the quick", "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    new_pid = core_pid(server.proc.pid)
    assert new_pid != old_pid and "engine core restarted" in server.log()
    assert b"multiprocessing.spawn" in cmdline(new_pid)
    m = server.metrics()
    assert server.value(m, "kvflow:kv_cache_free_blocks") == 95  # the new core's pool, idle


def _hang_up(server, rng: random.Random) -> None:
    """One client that leaves early: after 0-4 streamed chunks, or before a whole reply."""
    if rng.random() < 0.3:
        try:  # a reply that came in time is fine too: only the hang-ups matter here
            httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=rng.uniform(0.05, 1))
        except httpx.ReadTimeout:
            pass
        return
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as resp:
        chunks = resp.iter_lines()
        for _ in range(rng.randint(0, 4)):
            next(chunks)


def test_disconnect_storm_leaves_no_block_held(restarting):
    """32 clients, 4 running slots: most wait in the queue when they hang up."""
    server = restarting
    wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 200)
    threads = [threading.Thread(target=_hang_up, args=(restarting, random.Random(i)))
               for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def idle() -> bool:
        m = server.metrics()
        return server.value(m, "kvflow:kv_cache_free_blocks") == 95 and \
            server.value(m, "kvflow:num_requests_running") == 0 and \
            server.value(m, "kvflow:num_requests_waiting") == 0

    wait_for(idle, timeout=30)
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "the quick", "max_tokens": 3})
    assert resp.status_code == 200


def test_sigterm_aborts_open_requests(restarting):
    """SIGTERM to the server and its core (``pkill -f "kvflow serve"``, a systemd stop;
    ``docker stop`` and Ctrl-C reach the server alone and are handled the same) with a stream
    and a whole reply in flight: both end at once with code ``server_shutting_down`` (the stream with an error event
    then ``[DONE]``), not after uvicorn's 5 s graceful timeout with the stream cut. The engine
    core is stopped (SIGSTOP) once the stream has its first token, so neither request can
    finish before the signal however fast the machine (on a quiet one the tiny model's 200
    tokens took about a second, and the stream often ended before the signal); it continues
    (SIGCONT) once the server has logged that it aborted them. The last test of the module:
    the server stops here."""
    server = restarting
    whole = {}

    def post_whole() -> None:
        whole["resp"] = httpx.post(f"{server.url}/v1/completions", json={**LONG, "user": "whole"},
                                   timeout=60)

    events = []
    core = core_pid(server.proc.pid)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines)[6:])  # generating
        os.kill(core, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=post_whole)
            thread.start()
            wait_for(lambda: "user 'whole'" in server.log())  # the handler has it
            time.sleep(0.3)  # and has handed it to the engine client (it opens it at once)
            sent = time.monotonic()
            server.terminate()
            # and the core, as pkill -f "kvflow serve" (the forked core has the server's
            # command line) or a systemd stop (the whole group) do: delivered at SIGCONT
            os.kill(core, signal.SIGTERM)
            # the core stays stopped until the server has aborted both requests: continued at
            # once (was), a fast CPU (Zen 5, CI) generated the stream's remaining tokens before
            # the API process handled the signal, and the stream ended with a normal finish
            wait_for(lambda: "aborted 2 open request(s)" in server.log(), timeout=10)
        finally:
            os.kill(core, signal.SIGCONT)
        for line in lines:
            events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
        took = time.monotonic() - sent
    thread.join(30)
    # the stream was generating before the signal: its first event (read above) is a token;
    # whether more tokens arrived before the core stopped is a race (was: asserted of
    # events[0], the event after the first, which failed when none had)
    assert "error" not in first and first["choices"][0]["text"] is not None, first
    assert events[-1] == {"done": True}, events[-3:]
    assert events[-2]["error"]["code"] == "server_shutting_down", events[-2]
    assert "SIGTERM" in events[-2]["error"]["message"]
    assert whole["resp"].status_code == 503
    assert whole["resp"].json()["error"]["code"] == "server_shutting_down"
    assert took < 3.0  # uvicorn alone cut the stream after its 5 s graceful timeout
    assert "aborted 2 open request(s)" in server.log()
    # the core's end is part of the shutdown: no traceback (was: zmq.Again from the abort,
    # exit 1), no "engine core died", no restart; the server ends by the signal
    assert server.proc.wait(30) == -signal.SIGTERM, server.log()
    log = server.log()
    assert "Traceback" not in log and "engine core died" not in log, log
