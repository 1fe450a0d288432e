"""A process that has imported what ``kvflow serve`` imports and forks the test suite's servers.

Every ``kvflow serve`` that the end-to-end tests start used to be a new interpreter importing
torch, transformers and the engine again: about 2.5-3 s of CPU per server on the 2-core CI
machine (docs/benchmarks.md, session 41), on the critical path of each module's start-up. The
zygote imports them once; a server forked from it runs ``kvflow.entrypoints.cli.main()`` with
the server's command line, environment and log file, exactly as ``python -m
kvflow.entrypoints.cli`` would after its imports (a fresh process to kvflow: it forks its
engine core, ``kvflow/engine/start_method.py``).

Forking is safe because the zygote never computes: it imports, then waits on a Unix socket
(one thread of its own; numpy's OpenBLAS pool is fork-safe). A forked server differs from a
new interpreter only in what was read at import time, so :meth:`Zygote.usable_for` sends a
server whose environment could matter then (another OpenMP thread count, variables other
than kvflow's own, which kvflow reads when it runs) to ``subprocess.Popen`` instead.

Protocol: one JSON request per connection, one JSON reply. ``{"op": "start", "argv", "env",
"log"}`` -> ``{"pid"}``; ``{"op": "status", "pid"}`` -> ``{"returncode"}`` (None while it
runs; negative: killed by that signal, as ``subprocess``); ``{"op": "exit"}``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from tests.e2e.parent_death import die_with_parent

PRELOAD = ("kvflow.entrypoints.cli", "kvflow.entrypoints.api_server", "kvflow.engine.core_proc",
           "transformers.activations", "kvflow.models.llama")
_ZYGOTE_MAIN = "import sys; from tests.e2e.zygote import serve; serve(sys.argv[1])"
ZYGOTE_THREADS = "1"  # OMP_NUM_THREADS of the zygote, so of every server it forks
# vLLM's names that kvflow reads when the server starts (ServerConfig.from_cli_args)
RUN_TIME_VLLM_VARIABLES = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING",)


class Zygote:
    """The zygote seen from the test process: start it, ask it for servers, stop it.

    Args:
        env: the zygote's environment; ``OMP_NUM_THREADS`` is set to :data:`ZYGOTE_THREADS`.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self.env = {**env, "OMP_NUM_THREADS": ZYGOTE_THREADS}
        self._dir = tempfile.mkdtemp(prefix="kvflow-zygote-")
        self.path = os.path.join(self._dir, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE_MAIN, self.path], env=self.env,
            stdin=subprocess.DEVNULL)

    def usable_for(self, env: dict[str, str]) -> bool:
        """Whether a server with environment ``env`` may be forked from the zygote: it
        differs from the zygote's only in ``KVFLOW_*`` variables and the vLLM ones kvflow
        reads (:data:`RUN_TIME_VLLM_VARIABLES`), which kvflow reads when it runs, never at
        import (the OpenMP thread count, Hugging Face's folders and the like were read when
        the zygote imported), and pytest's ``PYTEST_*``."""
        names = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) for k in names
                   if not k.startswith(("KVFLOW_", "PYTEST_"))  # pytest's: the test's name
                   and k not in RUN_TIME_VLLM_VARIABLES)

    def ask(self, request: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """Send ``request``; returns the reply (waits for the zygote's imports the first
        time). Raises RuntimeError when the zygote has exited."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the test zygote exited with {self.proc.returncode}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.connect(self.path)
                    conn.sendall(json.dumps(request).encode() + b"\n")
                    return json.loads(conn.makefile("rb").readline())
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the test zygote did not answer") from None
                time.sleep(0.05)

    def start(self, argv: list[str], env: dict[str, str], log: str) -> ForkedServer:
        """Fork a process that runs ``kvflow`` with ``argv`` (after the program name)."""
        return ForkedServer(self, self.ask({"op": "start", "argv": argv, "env": env,
                                            "log": log})["pid"])

    def stop(self) -> None:
        """Ask the zygote to exit (its servers are stopped first, by the caller)."""
        with contextlib.suppress(RuntimeError, OSError):
            self.ask({"op": "exit"}, timeout=5)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._dir)


class ForkedServer:
    """The part of ``subprocess.Popen``'s interface the tests use, for a process the zygote
    forked (only the zygote, its parent, can read its exit status)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.ask({"op": "status", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status. Raises subprocess.TimeoutExpired after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"kvflow (pid {self.pid})", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---- in the zygote process ------------------------------------------------------------------
def serve(path: str) -> None:
    """The zygote's loop: import :data:`PRELOAD`, then answer requests on the Unix socket
    ``path`` until told to exit or until the test process is gone."""
    for name in PRELOAD:
        importlib.import_module(name)
    parent = os.getppid()
    statuses: dict[int, int | None] = {}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    while os.getppid() == parent:
        _reap(statuses)
        if not select.select([listener], [], [], 0.1)[0]:
            continue
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.makefile("rb").readline())
            if request["op"] == "exit":
                conn.sendall(b"{}\n")
                return
            if request["op"] == "start":
                sys.stdout.flush()
                sys.stderr.flush()
                zygote = os.getpid()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    _run_kvflow(request["argv"], request["env"], request["log"], zygote)
                statuses[pid] = None
                reply = {"pid": pid}
            else:
                _reap(statuses)
                reply = {"returncode": statuses.get(request["pid"])}
            conn.sendall(json.dumps(reply).encode() + b"\n")


def _reap(statuses: dict[int, int | None]) -> None:
    """Record the exit status of every child that ended (``subprocess``'s convention)."""
    for pid, code in statuses.items():
        if code is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = os.waitstatus_to_exitcode(status)


def _run_kvflow(argv: list[str], env: dict[str, str], log: str, zygote: int) -> None:
    """In the forked child: become ``kvflow <argv>`` with ``env``, output to ``log``; never
    returns. It gets SIGTERM when the zygote (pid ``zygote``) ends, so a test run killed
    mid-way leaves no server behind (:func:`die_with_parent`)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(zygote)
    os.environ.clear()
    os.environ.update(env)
    null, out = os.open(os.devnull, os.O_RDONLY), os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.argv = ["kvflow", *argv]
    code = 1
    try:
        from kvflow.entrypoints.cli import main

        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
