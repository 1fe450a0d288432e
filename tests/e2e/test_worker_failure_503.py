"""``kvflow serve --tensor-parallel-size 2``: a worker process killed mid-stream. The open
stream ends with an error event that names the dead rank, the server answers 503 while the
engine is down, no worker or engine-core process is left behind, and with
``--engine-failure restart`` a new core with new workers serves again."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx

from tests.e2e.test_engine_faults import ARGS, LONG, assert_ends_with_error_event, wait_for

SERVER_ARGS = [*ARGS, "--tensor-parallel-size", "2", "--engine-failure", "restart"]


def _descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid``: pid -> command line (from /proc)."""
    parent_of, cmdline = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            child = int(stat.parent.name)
            parent_of[child] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline[child] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, p in parent_of.items():
            if p == parent and child not in found:
                found[child] = cmdline[child].decode(errors="replace")
                frontier.append(child)
    return found


def _engine_processes(server_pid: int) -> dict[int, str]:
    """The engine-core process and its worker processes."""
    return {p: cmd for p, cmd in _descendants(server_pid).items()
            if "kvflow.executor.mp_worker" in cmd or _comm(p) == "kvflow-core"}


def _comm(pid: int) -> str:
    """The process's kernel name (the engine core names itself ``kvflow-core``)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), SERVER_ARGS, None)]


def test_killed_worker_gives_503_then_a_restarted_engine(start_server, request):
    server = start_server.declared(request)
    old = _engine_processes(server.proc.pid)
    workers = sorted(p for p, cmd in old.items() if "mp_worker" in cmd)
    assert len(old) == 3 and len(workers) == 2, old
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(lines)
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()
        for line in lines:
            events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
    assert time.monotonic() - killed_at < 10
    assert_ends_with_error_event(events)
    assert f"worker rank 1 (pid {workers[1]}) died" in events[-2]["error"]["message"]
    refused = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    wait_for(lambda: not any(_alive(p) for p in old), timeout=15)  # no orphan of the old core
    wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 200,
             timeout=120)
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,  # sampled: ignore EOS
                      json={"prompt": "the quick", "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    new = _engine_processes(server.proc.pid)
    assert len(new) == 3 and not set(new) & set(old)  # a new core with two new workers
    server.terminate()

