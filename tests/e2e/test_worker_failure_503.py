"""``kvflow serve --tensor-parallel-size 2``: when a worker process dies the server keeps
answering, with 503 (health and requests), names the dead rank, and leaves no worker or
engine-core process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest


def _children(pid: int) -> dict[int, str]:
    """All descendants of ``pid``: pid -> command line (from /proc)."""
    parent_of, cmdline = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parent_of.items():
            if parent == p and child not in found:
                found[child] = cmdline[child].decode(errors="replace")
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_dead_worker_turns_the_server_into_503s(start_server, tiny_chat_model):
    server = start_server(tiny_chat_model, ["--tensor-parallel-size", "2",
                                            "--num-kv-blocks", "64"])
    body = {"model": tiny_chat_model, "prompt": "the lazy fox", "max_tokens": 4,
            "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    family = _children(server.proc.pid)
    workers = sorted(p for p, cmd in family.items() if "kvflow.executor.mp_worker" in cmd)
    assert len(workers) == 2, family
    os.kill(workers[1], signal.SIGKILL)
    deadline = time.monotonic() + 10  # an idle core checks its workers every second
    while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "health still 200 after a worker died"
        time.sleep(0.2)
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    assert reply.status_code == 503
    assert f"worker rank 1 (pid {workers[1]}) died" in reply.json()["error"]["message"]
    engine = [p for p, cmd in family.items()  # the engine-core process and the workers
              if "kvflow.executor.mp_worker" in cmd or "spawn_main" in cmd]
    assert len(engine) == 3, family
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in engine):
        assert time.monotonic() < deadline, \
            f"left behind: {[family[p] for p in engine if _alive(p)]}"
        time.sleep(0.2)
    assert server.proc.poll() is None  # the API process itself still answers
    server.stop()


@pytest.fixture(autouse=True)
def _one_thread_per_worker(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
