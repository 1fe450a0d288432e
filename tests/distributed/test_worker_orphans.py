"""Tensor-parallel workers do not outlive their engine's process (kvflow/executor/mp_worker.py:
the death pipe). Oracle: /proc, read for the worker pids the engine's process printed."""

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

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def kill_script_and_check_cleanup(script: Path, tmp_path: Path, folder_glob: str) -> None:
    """Run ``script`` (it prints its two child processes' pids on one line, then sleeps) with
    a private TMPDIR; once it printed, check both children run and a ``folder_glob`` folder
    is there, SIGKILL the script, and assert that within 15 s both children exited and the
    folder is gone. Whatever is left is killed."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)})
    pids: list[int] = []
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(process_running(pid) for pid in pids)
        assert list(temp.glob(folder_glob))  # the script's, while it runs
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(process_running(pid) for pid in pids):
            time.sleep(0.1)
        assert not [pid for pid in pids if process_running(pid)]
        assert not list(temp.glob(folder_glob))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        for pid in pids:  # a failed run leaves no child behind either
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)


def test_workers_exit_when_the_engine_process_is_killed(tiny_model_factory, tmp_path):
    """A script (no main guard) that builds a two-rank offline LLM prints its workers' pids and
    is SIGKILLed (SIGTERM's default action is the same: no clean-up either): nothing could
    tell the workers to stop, yet both exit within seconds (their end of the death pipe reads
    EOF), instead of holding their memory and cores forever, and the executor's
    ``kvflow-mp-*`` folder (sockets, pickled worker arguments) is gone with them (was: left in
    the temporary directory)."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from kvflow import LLM
        llm = LLM(model={tiny_model_factory("llama").path!r}, dtype="float32",
                  num_kv_blocks=64, tensor_parallel_size=2)
        print(*[p.pid for p in llm.engine.core.executor._procs], flush=True)
        time.sleep(600)
    """))
    kill_script_and_check_cleanup(script, tmp_path, "kvflow-mp-*")
