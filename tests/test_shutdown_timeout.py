"""vLLM's ``--shutdown-timeout S``: on SIGTERM / Ctrl-C the server refuses new requests (503,
``server_shutting_down``) and lets the open ones run for up to S seconds, aborting those left;
0 (the default) aborts them at once. ``AbortingServer.shutdown`` driven over a stand-in engine
whose open requests end at chosen times (uvicorn's own shutdown stubbed out); the served
behaviour is in tests/e2e/test_openai_shutdown_timeout.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvicorn

from kvflow.config import ServerConfig
from kvflow.engine.streams import EngineShutdownError
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.server_shutdown import AbortingServer


class _Engine:
    """Open requests that finish ``finish_after_s`` after the drain starts (None: never)."""

    def __init__(self, open_requests: int, finish_after_s: float | None) -> None:
        self.open, self.finish_after_s = open_requests, finish_after_s
        self.events: list[tuple[str, object]] = []
        self.is_healthy, self._start = True, None

    def refuse_new(self, error: EngineShutdownError) -> None:
        self.events.append(("refuse_new", str(error)))
        self.is_healthy, self._start = False, time.monotonic()

    @property
    def num_open_requests(self) -> int:
        done = self.finish_after_s is not None and self._start is not None and \
            time.monotonic() - self._start >= self.finish_after_s
        return 0 if done else self.open

    def abort_all(self, error: EngineShutdownError) -> int:
        self.events.append(("abort_all", self.num_open_requests))
        return self.num_open_requests


@pytest.fixture(autouse=True)
def _no_uvicorn_shutdown(monkeypatch):
    async def nothing(self, sockets=None) -> None:
        return None
    monkeypatch.setattr(uvicorn.Server, "shutdown", nothing)


def _shutdown(engine: _Engine, drain_s: float) -> float:
    server = AbortingServer(uvicorn.Config(app=None), engine, drain_s)
    start = time.monotonic()
    asyncio.run(server.shutdown())
    return time.monotonic() - start


def test_open_requests_finish_within_the_timeout():
    engine = _Engine(2, finish_after_s=0.3)
    took = _shutdown(engine, 5.0)
    assert 0.3 <= took < 2.0  # waited for them, not the whole 5 s
    assert engine.events[0][0] == "refuse_new" and "no new requests" in engine.events[0][1]
    assert engine.events[1] == ("abort_all", 0)  # nothing left to abort


def test_left_over_requests_aborted_at_the_timeout():
    engine = _Engine(3, finish_after_s=None)
    took = _shutdown(engine, 0.4)
    assert 0.4 <= took < 2.0
    assert [e[0] for e in engine.events] == ["refuse_new", "abort_all"]
    assert engine.events[1] == ("abort_all", 3)


def test_default_aborts_at_once():
    engine = _Engine(3, finish_after_s=0.3)
    assert _shutdown(engine, 0.0) < 0.2
    assert engine.events == [("abort_all", 3)]  # no drain: new requests never refused first


def test_second_signal_ends_the_wait():
    engine = _Engine(1, finish_after_s=None)
    server = AbortingServer(uvicorn.Config(app=None), engine, 30.0)

    async def run() -> None:
        task = asyncio.create_task(server.shutdown())
        await asyncio.sleep(0.2)
        server.force_exit = True  # what uvicorn's handler sets on a second Ctrl-C
        await asyncio.wait_for(task, 2)
    asyncio.run(run())
    assert engine.events[-1] == ("abort_all", 1)


def test_flag(capsys):
    args = build_parser().parse_args(["serve", "m", "--shutdown-timeout", "30"])
    assert ServerConfig.from_cli_args(args, env={}).shutdown_timeout == 30
    assert main(["serve", "m", "--shutdown-timeout", "-1"]) == 2
    assert "must be >= 0 seconds" in capsys.readouterr().err
