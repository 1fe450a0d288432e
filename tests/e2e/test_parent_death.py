"""A test server started by ``subprocess.Popen`` (``ServerProcess`` without the zygote: the path
of servers whose environment the zygote cannot give) ends when the test process is SIGKILLed
(tests/e2e/parent_death.py: was, it served on with its engine core until someone killed it).
Oracle: /proc, for the pids of the server and of its engine core."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.e2e.parent_death import process_running
from tests.e2e.test_engine_faults import core_pid

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")
ROOT = Path(__file__).resolve().parents[2]


def test_a_popen_server_ends_with_its_killed_test_process(tiny_llama, tmp_path):
    script = tmp_path / "tests_process.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from tests.e2e.conftest import ServerProcess
        server = ServerProcess({tiny_llama.path!r}, ["--dtype", "float32", "--num-kv-blocks",
                               "32"], Path({str(tmp_path / "server.log")!r}))
        server.wait_ready()
        print(server.proc.pid, flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    pids: list[int] = []
    try:
        server = int(proc.stdout.readline())
        pids = [server, core_pid(server)]
        assert all(process_running(pid) for pid in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(process_running(pid) for pid in pids):
            time.sleep(0.1)
        assert [pid for pid in pids if process_running(pid)] == []  # was: both served on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        for pid in pids:
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
