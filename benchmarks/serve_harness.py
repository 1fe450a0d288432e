"""What the serving benchmarks share (soak_serve.py, slo_goodput.py, gpu_serve.py): start
``kvflow serve`` on a free 127.0.0.1 port, wait for its /health, run ``kvflow bench serve``
against it and read the result JSON, stop it. Scripts import it as a sibling module (they run
as ``python benchmarks/<name>.py``, which puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

KVFLOW = [sys.executable, "-m", "kvflow.entrypoints.cli"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: Sequence[str], log: Path,
                 env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``kvflow serve *serve_args --host 127.0.0.1 --port <free port>`` with its output
    in ``log``; returns the process and its base URL without waiting (see ``wait_ready``)."""
    port = free_port()
    cmd = [*KVFLOW, "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as f:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=None if env is None else dict(env))
    return proc, f"http://127.0.0.1:{port}"


def is_healthy(url: str) -> bool:
    """Whether ``url``/health answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 600.0,
               poll_s: float = 0.5) -> None:
    """Wait until the server at ``url`` is healthy.

    Raises:
        RuntimeError: if the server exits first, or is not healthy within ``timeout``
            seconds (then it is killed).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvflow serve ({url}) exited with {proc.returncode}")
        if is_healthy(url):
            return
        time.sleep(poll_s)
    proc.kill()
    raise RuntimeError(f"kvflow serve ({url}) was not healthy after {timeout:g} s")


def bench_serve(url: str, bench_args: Sequence[str], result: Path,
                quiet: bool = False) -> dict:
    """One ``kvflow bench serve --base-url url *bench_args``; returns its result JSON (a run
    whose requests partly failed exits 1 but still writes one). ``quiet``: drop its stdout.

    Raises:
        RuntimeError: if it wrote no result.
    """
    cmd = [*KVFLOW, "bench", "serve", "--base-url", url, *bench_args,
           "--result-json", str(result), "--disable-tqdm"]
    result.unlink(missing_ok=True)
    code = subprocess.run(cmd, check=False,
                          stdout=subprocess.DEVNULL if quiet else None).returncode
    if not result.exists():
        raise RuntimeError(f"kvflow bench serve exited with {code} and wrote no {result}")
    return json.loads(result.read_text())


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
