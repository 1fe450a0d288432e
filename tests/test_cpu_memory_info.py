"""The CPU platform's free-memory figure (what the KV-cache size check compares against) is
Linux's MemAvailable, as psutil reports it, not the free pages alone."""

from __future__ import annotations

import sys

import pytest

from kvflow.platforms.cpu import CpuPlatform, mem_available


def test_parses_mem_available(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       24684544 kB\nMemFree:          236544 kB\n"
                    "MemAvailable:    9703424 kB\nBuffers:            1024 kB\n")
    assert mem_available(str(path)) == 9703424 * 1024
    path.write_text("MemTotal:       24684544 kB\nMemFree:          236544 kB\n")
    assert mem_available(str(path)) is None
    assert mem_available(str(tmp_path / "missing")) is None


@pytest.mark.skipif(sys.platform != "linux", reason="MemAvailable is Linux's")
def test_matches_psutil_available():
    psutil = pytest.importorskip("psutil")
    ours, total = CpuPlatform().memory_info()
    theirs = psutil.virtual_memory()
    assert total == theirs.total
    # two reads a moment apart on a shared machine: within 256 MiB of each other
    assert abs(ours - theirs.available) < 256 * 2**20
