"""Worker-process faults and shutdown of a tensor-parallel engine (TP=2, gloo on CPU), end to
end with real processes: too slow for the test suite (a server start per case, 20-60 s each
on 2 busy cores). Run it after touching the executor, the workers or the engine-core loop.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/worker_faults.py [CASE ...]

Cases (default: all):

* ``serve-kill``: ``kvflow serve --tensor-parallel-size 2``, one streamed and one whole
  completion in flight, then rank 1's worker gets SIGKILL. Both requests must end with an
  error naming the rank (stream: an error event then ``[DONE]``; whole: HTTP 5xx with an
  OpenAI error body) within 10 s, the server must exit (``--engine-failure exit``), and no
  worker process, executor folder or new ``/dev/shm`` segment may be left.
* ``serve-stop``: the same with SIGSTOP (a worker alive but not running) and
  ``--worker-heartbeat-timeout 3``: the error must name the stopped rank.
* ``serve-sigint``: Ctrl-C (SIGINT) to the server with a request in flight: exit within 15 s,
  nothing left behind (what the request gets, and other signals and moments, are
  ``benchmarks/server_signals.py``'s).
* ``llm-gc``: an offline ``LLM(tensor_parallel_size=2)`` dropped without ``shutdown()`` (``del``
  and garbage collection): its workers must be gone within 10 s, the process still running.

Prints one line per check and exits 1 if any failed; the servers' logs stay in a
``kvflow-faults-logs-*`` folder under the temp directory (printed first).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import httpx
import psutil
from tiny_cases import build_model, parse_cases

os.environ.setdefault("OMP_NUM_THREADS", "1")

CASES = ("serve-kill", "serve-stop", "serve-sigint", "llm-gc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers_of(pid: int) -> list[psutil.Process]:
    """The ``kvflow.executor.mp_worker`` processes below process ``pid``."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if "kvflow.executor.mp_worker" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return sorted(out, key=lambda p: int(p.cmdline()[-2]))  # by rank


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def completion_in_thread(url: str, body: dict, into: dict) -> threading.Thread:
    """POST ``body`` to ``url``/v1/completions in a daemon thread (started, returned); ``into``
    gets ``status`` (None when the connection failed), the whole response ``text`` and
    ``ended`` (time.monotonic() when it ended). Shared with server_signals.py."""
    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                into["status"] = r.status_code
                into["text"] = "".join(r.iter_text())
        except httpx.HTTPError as e:
            into["status"], into["text"] = None, repr(e)
        into["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class Report:
    """PASS/FAIL lines; ``failed`` counts the failures."""

    def __init__(self) -> None:
        self.failed = 0

    def check(self, case: str, ok: bool, what: str) -> None:
        self.failed += not ok
        print(f"{case:13s} {'PASS' if ok else 'FAIL'}  {what}", flush=True)


class Server:
    """``kvflow serve`` of the tiny model with TP=2 in a child process."""

    def __init__(self, model: str, log: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.log = open(log, "w")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow", "serve", model, "--dtype", "float32",
             "--tensor-parallel-size", "2", "--num-kv-blocks", "256", "--port",
             str(self.port), *extra], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): see {log}")
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the server did not start: see {log}")
        self.workers = workers_of(self.proc.pid)
        self.folder = os.path.dirname(self.workers[0].cmdline()[-3])

    def body(self, stream: bool) -> dict:
        return {"model": self.model, "prompt": "hello", "max_tokens": 240,
                "ignore_eos": True, "temperature": 0, "stream": stream}

    def request_in_thread(self, stream: bool, into: dict) -> threading.Thread:
        """Send a completion; ``into`` gets status, text and when it ended."""
        return completion_in_thread(self.url, self.body(stream), into)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for w in self.workers:
            if w.is_running():
                w.kill()
        self.log.close()


def left_behind(case: str, report: Report, server: Server, shm_before: set[str]) -> None:
    time.sleep(1.0)
    alive = [w.pid for w in server.workers if w.is_running() and
             w.status() != psutil.STATUS_ZOMBIE]
    report.check(case, not alive, f"no worker process left (alive: {alive})")
    report.check(case, not os.path.exists(server.folder),
                 f"executor folder removed ({server.folder})")
    new_shm = sorted(shm_entries() - shm_before)
    report.check(case, not new_shm, f"no new /dev/shm segment ({new_shm[:5]})")


def fault_case(case: str, model: str, folder: str, report: Report) -> None:
    """serve-kill / serve-stop: a worker fault with two requests in flight."""
    stop = case == "serve-stop"
    shm_before = shm_entries()
    server = Server(model, os.path.join(folder, f"{case}.log"),
                    *(["--worker-heartbeat-timeout", "3"] if stop else []))
    try:
        whole, streamed = {}, {}
        threads = [server.request_in_thread(False, whole),
                   server.request_in_thread(True, streamed)]
        time.sleep(2.0)
        victim = server.workers[1]
        faulted = time.monotonic()
        victim.send_signal(signal.SIGSTOP if stop else signal.SIGKILL)
        for t in threads:
            t.join(60)
        limit = 10.0
        for name, got in (("whole", whole), ("streamed", streamed)):
            took = got.get("ended", float("inf")) - faulted
            report.check(case, took < limit, f"{name} request answered {took:.1f} s after "
                         f"the fault (limit {limit:.0f} s)")
        ok = whole.get("status", 0) and whole["status"] >= 500
        try:
            error = json.loads(whole.get("text", "")).get("error", {})
        except json.JSONDecodeError:
            error = {}
        report.check(case, bool(ok) and "worker rank 1" in error.get("message", ""),
                     f"whole: HTTP {whole.get('status')} {whole.get('text', '')[:160]!r}")
        text = streamed.get("text", "")
        report.check(case, '"error"' in text and "worker rank 1" in text and
                     text.rstrip().endswith("data: [DONE]"),
                     f"streamed: error event naming rank 1, then [DONE] "
                     f"({text.strip().splitlines()[-3:] if text else None})")
        try:
            code = server.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        report.check(case, code is not None, f"server exited (status {code}) after the fault")
        left_behind(case, report, server, shm_before)
    finally:
        server.stop()


def sigint_case(model: str, folder: str, report: Report) -> None:
    """serve-sigint: Ctrl-C with a request in flight."""
    case = "serve-sigint"
    shm_before = shm_entries()
    server = Server(model, os.path.join(folder, f"{case}.log"))
    try:
        got: dict = {}
        server.request_in_thread(True, got)
        time.sleep(2.0)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        try:
            code = server.proc.wait(15)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - sent
        report.check(case, code is not None, f"server exited (status {code}) "
                     f"{took:.1f} s after SIGINT")
        left_behind(case, report, server, shm_before)
    finally:
        server.stop()


def gc_case(model: str, report: Report) -> None:
    """llm-gc: an offline TP=2 engine dropped without shutdown()."""
    from kvflow import LLM, SamplingParams

    case = "llm-gc"
    shm_before = shm_entries()
    llm = LLM(model=model, dtype="float32", num_kv_blocks=96, tensor_parallel_size=2)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    workers = workers_of(os.getpid())
    folder = os.path.dirname(workers[0].cmdline()[-3])
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(w.is_running() for w in workers):
        time.sleep(0.2)
    alive = [w.pid for w in workers if w.is_running()]
    report.check(case, not alive, f"workers gone after del + gc.collect() (alive: {alive})")
    report.check(case, not os.path.exists(folder), f"executor folder removed ({folder})")
    new_shm = sorted(shm_entries() - shm_before)
    report.check(case, not new_shm, f"no new /dev/shm segment ({new_shm[:5]})")


def run_cases(doc: str, cases: tuple[str, ...], name: str,
              run_case: Callable[[str, str, str, Report], None]) -> int:
    """Run the cases named on the command line (``parse_cases``; all when none) one after
    another as ``run_case(case, model, logs, report)``, ``model`` the tiny Llama saved in a
    ``kvflow-{name}-*`` temporary folder, ``logs`` a ``kvflow-{name}-logs-*`` folder that stays
    (printed first). Returns the exit status: 1 if any check failed, else 0."""
    selected = parse_cases(doc, cases)
    report = Report()
    logs = tempfile.mkdtemp(prefix=f"kvflow-{name}-logs-")
    print(f"server logs in {logs}", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"kvflow-{name}-") as folder:
        model = build_model(folder)
        for case in selected:
            run_case(case, model, logs, report)
    return 1 if report.failed else 0


def run_case(case: str, model: str, logs: str, report: Report) -> None:
    if case in ("serve-kill", "serve-stop"):
        fault_case(case, model, logs, report)
    elif case == "serve-sigint":
        sigint_case(model, logs, report)
    else:
        gc_case(model, report)


def main() -> int:
    return run_cases(__doc__, CASES, "faults", run_case)


if __name__ == "__main__":
    sys.exit(main())
