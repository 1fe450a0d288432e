"""``ServerProcess.wait_ready``'s time limit (tests/e2e/conftest.py): ``START_TIMEOUT_S``
stretched by the CPUs' oversubscription (``load_factor``), so a server starting on a machine
running several suites is not failed for the machine's load. Checked with a stand-in clock
and load average (no server, no real waiting)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
import pytest

from tests.e2e import conftest
from tests.e2e.conftest import ServerProcess, load_factor


@pytest.mark.parametrize("load,cpus,factor", [(10.0, 2, 5.0), (1.0, 2, 1.0), (3.0, 4, 1.0),
                                              (6.0, 4, 1.5)])
def test_load_factor_is_the_load_per_cpu_at_least_1(monkeypatch, load, cpus, factor):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert load_factor() == factor


def test_load_factor_is_1_without_a_load_average(monkeypatch):
    def unreadable():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", unreadable)
    assert load_factor() == 1.0


def test_wait_ready_gives_up_after_the_timeout_times_the_load_factor(monkeypatch, tmp_path):
    clock = SimpleNamespace(now=0.0, polls=0)

    def sleep(seconds: float) -> None:
        clock.now += seconds

    def refused(*args, **kwargs):
        clock.polls += 1
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(conftest.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(conftest.time, "sleep", sleep)
    monkeypatch.setattr(conftest.httpx, "get", refused)
    monkeypatch.setattr(conftest, "load_factor", lambda: 3.0)
    server = ServerProcess.__new__(ServerProcess)  # no process started
    server.proc = SimpleNamespace(poll=lambda: None)
    server.url = "http://127.0.0.1:1"
    server.log_path = tmp_path / "server.log"
    server.log_path.write_text("starting\n")
    with pytest.raises(RuntimeError, match=r"not ready after 3 s \(timeout 1 s, load factor "
                                           r"3.0\):\nstarting"):
        server.wait_ready(timeout=1.0)
    assert clock.polls == 12  # every 0.25 s for 3 s, not 4 polls for 1 s
