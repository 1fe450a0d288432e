"""benchmarks/served_cpu_split.py's /proc readers against psutil (an independent reader of the
same kernel counters) on processes this test starts and keeps busy."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "served_cpu_split.py"


@pytest.fixture(scope="module")
def split():
    spec = importlib.util.spec_from_file_location("served_cpu_split", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def _busy_child(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _BUSY.format(s=seconds)])


def _wait_for_cpu(pid: int, cpu_s: float, timeout_s: float = 30.0) -> None:
    """Wait until psutil sees ``cpu_s`` CPU seconds spent by ``pid`` (a fixed sleep gave a
    busy child too little CPU on a loaded machine: load 10 on 2 cores)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        times = psutil.Process(pid).cpu_times()
        if times.user + times.system >= cpu_s:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} spent under {cpu_s} CPU s in {timeout_s} s")


def test_proc_and_thread_cpu_match_psutil(split):
    child = _busy_child(1.5)
    try:
        _wait_for_cpu(child.pid, 0.2)
        ours = split.proc_cpu_s(child.pid)
        threads = split.thread_cpu_s(child.pid)
        times = psutil.Process(child.pid).cpu_times()
        theirs = times.user + times.system
        # read a few ms apart, at clock-tick (10 ms) resolution
        assert ours == pytest.approx(theirs, abs=0.05)
        assert ours > 0.1
        assert sum(threads.values()) == pytest.approx(ours, abs=0.05)
    finally:
        child.wait()
    assert split.proc_cpu_s(child.pid) == 0.0  # gone: no error


def test_descendants_and_engine_cpu(split):
    # a child that starts a busy grandchild: both found, the grandchild's CPU counted
    code = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            f"{_BUSY.format(s=1.5)!r}]); p.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.02)
        _wait_for_cpu(psutil.Process(parent.pid).children()[0].pid, 0.2)
        found = split.descendants(parent.pid)
        expected = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        assert sorted(found) == sorted(expected) and len(found) == 1
        by_name = split.engine_cpu_s(found)
        assert sum(by_name.values()) == pytest.approx(split.proc_cpu_s(found[0]), abs=0.05)
        assert sum(by_name.values()) > 0.1
    finally:
        parent.wait()


def test_machine_busy_counts_our_cpu(split):
    before, own0 = split.machine_busy_s(), time.process_time()
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    busy, own = split.machine_busy_s() - before, time.process_time() - own0
    assert busy >= own - 0.03  # the machine was at least as busy as this process
    assert busy <= (os.cpu_count() or 1) * 5  # and not absurdly more (a parsing error)
