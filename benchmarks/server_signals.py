"""How ``kvflow serve`` stops, end to end with real processes on the suite's tiny Llama: too
slow for the test suite (a server start per case, 20-90 s each on 2 busy cores). Run it after
touching the server's start-up or shutdown, the engine-core client or the CLI.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/server_signals.py [CASE ...]

Cases (default: all):

* ``sigint``: Ctrl-C (SIGINT) with a stream and a whole completion in flight: the stream ends
  with an error event (code ``server_shutting_down``) then ``data: [DONE]``, the whole one
  gets a 503 with that code, the server exits 130 within 3 s, no traceback in its log, no
  child process left.
* ``sigterm``: the same with SIGTERM (``docker stop``, Kubernetes): the server ends by that
  signal.
* ``sigint-twice``: a client that never sends its whole body keeps a request open (not an
  engine request, so nothing aborts it; uvicorn waits 5 s for it): a second SIGINT exits at
  once (within 2 s), status 130.
* ``sigint-loading``: SIGINT while a tensor-parallel (TP=2) model loads (before /health
  answers): exit 130 within 3 s, no traceback, no child process and no ``kvflow-mp-*``
  executor folder left.
* ``sigterm-loading``: the same with SIGTERM (a pod replaced while it loads): the server ends
  by that signal.
* ``port-in-use``: ``--port`` taken by another socket: one ``kvflow: error:`` line naming the
  port, status 2, before the model loads.
* ``dp-sigint``: ``--data-parallel-size 2`` with two streams, SIGINT: both
  streams end as in ``sigint``, every engine-core process is gone.
* ``sigint-long-step``: SIGINT 1 s into a long prefill (a 4,000-token prompt to the packaged
  SmolLM2-135M's HF export, ``out/smollm2-hf`` from ``benchmarks/export_hf.py``, in fp32;
  skipped without it): the engine core, still in its step after the 1 s it is given to read
  ``Shutdown``, gets SIGTERM and stops between two operations, so the server exits 130 within
  3 s. The prompt's whole prefill is timed first and printed: the case tests something only
  where it takes longer than that (about 4 s on 2 Zen 4 cores).
* ``sigint-twice-long-step``: the same with a second SIGINT 0.3 s after the first: the core
  gets SIGTERM at once (no 1 s grace), so the server exits 130 within 1 s of the first.

In the signal cases the engine cores are stopped (SIGSTOP) while the requests are sent and
continued (SIGCONT) right after the signal, so the requests are open when it arrives however
fast the machine (the tiny model's 240 tokens take ~0.25 s on a quiet one).

Prints one line per check and exits 1 if any failed; the servers' logs stay in a
``kvflow-signals-logs-*`` folder under the temp directory (printed first).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_faults import Report, completion_in_thread, free_port, run_cases

os.environ.setdefault("OMP_NUM_THREADS", "1")

CASES = ("sigint", "sigterm", "sigint-twice", "sigint-loading", "sigterm-loading",
         "port-in-use", "dp-sigint", "sigint-long-step", "sigint-twice-long-step")
SMOLLM2_HF = "out/smollm2-hf"  # benchmarks/export_hf.py
LONG = {"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "temperature": 0}


class Server:
    """``kvflow serve`` of the tiny model in a child process (``wait``: until /health)."""

    def __init__(self, model: str, log: str, *extra: str, port: int | None = None,
                 wait: bool = True) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow", "serve", model, "--dtype", "float32",
             "--num-kv-blocks", "256", "--max-model-len", "256", "--port", str(self.port),
             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._copier = threading.Thread(target=self._copy_log, daemon=True)
        self._copier.start()
        self.children: list[psutil.Process] = []
        if wait:
            self.wait_ready()

    def _copy_log(self) -> None:
        """The server's output to the log file, each line stamped with the seconds since
        the epoch (``time.time()``, as the signal lines below), so a slow stop shows where."""
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(f"{time.time():.2f} | {line}")
            self.log.flush()

    def mark(self, what: str) -> None:
        self.log.write(f"{time.time():.2f} | >>> {what}\n")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.children = psutil.Process(self.proc.pid).children(recursive=True)
                    self.warm_up()
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): see "
                                   f"{self.log_path}")
            time.sleep(0.5)
        raise RuntimeError(f"the server did not start: see {self.log_path}")

    def warm_up(self) -> None:
        """A few requests first, as a server in use has served: a cold core's first prefill
        picks its attention kernels, seconds on a busy machine, and a core finishes its
        step before it reads ``Shutdown``."""
        threads = [threading.Thread(target=httpx.post, args=(self.url + "/v1/completions",),
                                    kwargs={"json": {**LONG, "max_tokens": 2}, "timeout": 120})
                   for _ in range(4)]  # at once: each data-parallel replica gets some
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def request_in_thread(self, stream: bool, into: dict, user: str = "") -> threading.Thread:
        """Send a completion (``user`` its OpenAI user field); ``into`` gets status, text and
        when it ended."""
        return completion_in_thread(self.url, {**LONG, "stream": stream, "user": user}, into)

    def engine_cores(self) -> list[psutil.Process]:
        """The engine-core processes (named ``kvflow-core``, ``kvflow-core-N`` with data
        parallelism; forked or spawned: kvflow/engine/start_method.py)."""
        return [c for c in psutil.Process(self.proc.pid).children(recursive=True)
                if c.name().startswith("kvflow-core")]

    def signal_and_wait(self, sig: signal.Signals, resume: list[psutil.Process] = (),
                        timeout: float = 15) -> tuple[int | None, float]:
        """Send ``sig`` (marked in the log), continue the processes in ``resume`` (stopped
        with SIGSTOP so that their requests stayed open) and wait up to ``timeout`` s for the
        exit: (exit status or None, seconds from the signal to the exit)."""
        sent = time.monotonic()
        self.mark(sig.name)
        self.proc.send_signal(sig)
        for proc in resume:
            proc.resume()
        code = self.wait_exit(timeout)
        return code, time.monotonic() - sent

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def text(self) -> str:
        """The server's output (without the stamps), all of it once the server exited."""
        if self.proc.poll() is not None:
            self._copier.join(10)
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for child in self.children:
            if child.is_running():
                child.kill()
        self._copier.join(10)
        self.log.close()


def left_behind(case: str, report: Report, server: Server) -> None:
    time.sleep(0.5)
    alive = [c.pid for c in server.children if c.is_running() and
             c.status() != psutil.STATUS_ZOMBIE]
    report.check(case, not alive, f"no child process left (alive: {alive})")
    report.check(case, "Traceback" not in server.text(), "no traceback in the log")


def shutting_down(case: str, report: Report, name: str, got: dict, stream: bool) -> None:
    text = got.get("text", "")
    if stream:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        ok = len(events) >= 2 and events[-1] == "[DONE]" and \
            '"server_shutting_down"' in events[-2]
        report.check(case, ok, f"{name}: an error event (server_shutting_down) then [DONE] "
                     f"({events[-2:]})")
    else:
        try:
            code = json.loads(text)["error"]["code"]
        except (json.JSONDecodeError, KeyError, TypeError):
            code = None
        report.check(case, got.get("status") == 503 and code == "server_shutting_down",
                     f"{name}: HTTP {got.get('status')} {text[:120]!r}")


def signal_case(case: str, model: str, logs: str, report: Report) -> None:
    """sigint / sigterm / dp-sigint: the signal with requests in flight."""
    dp = case == "dp-sigint"
    sig = signal.SIGTERM if case == "sigterm" else signal.SIGINT
    server = Server(model, os.path.join(logs, f"{case}.log"),
                    *(["--data-parallel-size", "2"] if dp else []))
    try:
        results: list[tuple[str, dict, bool]] = [(f"stream {i}", {}, True)
                                                 for i in range(2 if dp else 1)]
        if not dp:
            results.append(("whole", {}, False))
        # the engine cores stopped (SIGSTOP) until the signal is sent, so that no request
        # finishes first (the tiny model's 240 tokens take ~0.25 s on a quiet machine): all
        # are open in the server, queued for the cores
        cores = server.engine_cores()
        for core in cores:
            core.suspend()
        for name, got, stream in results:
            server.request_in_thread(stream, got, name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                f"user '{name}'" in server.text() for name, _, _ in results):
            time.sleep(0.05)
        time.sleep(0.3)  # each handler has handed its request to the engine client
        code, took = server.signal_and_wait(sig, resume=cores)
        want = 130 if sig == signal.SIGINT else -signal.SIGTERM
        report.check(case, code == want and took < 3.0,
                     f"exited with status {code} (want {want}) {took:.1f} s after "
                     f"{sig.name} (limit 3 s)")
        for name, got, stream in results:
            shutting_down(case, report, name, got, stream)
        left_behind(case, report, server)
    finally:
        server.stop()


def twice_case(model: str, logs: str, report: Report) -> None:
    """sigint-twice: a request that never ends keeps uvicorn waiting; Ctrl-C again."""
    case = "sigint-twice"
    server = Server(model, os.path.join(logs, f"{case}.log"))
    try:
        hung = socket.create_connection(("127.0.0.1", server.port))
        hung.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        time.sleep(0.5)
        server.mark("SIGINT")
        server.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        report.check(case, server.proc.poll() is None,
                     "still waiting for the open request after the first SIGINT")
        sent = time.monotonic()
        server.mark("second SIGINT")
        server.proc.send_signal(signal.SIGINT)
        code = server.wait_exit(15)
        took = time.monotonic() - sent
        report.check(case, code == 130 and took < 2.0,
                     f"exited with status {code} {took:.1f} s after the second SIGINT")
        hung.close()
        left_behind(case, report, server)
    finally:
        server.stop()


def loading_case(case: str, model: str, logs: str, report: Report) -> None:
    """sigint-loading / sigterm-loading: the signal before the model is loaded."""
    sig = signal.SIGTERM if case == "sigterm-loading" else signal.SIGINT
    want = 130 if sig == signal.SIGINT else -signal.SIGTERM
    folders = set(glob.glob(os.path.join(tempfile.gettempdir(), "kvflow-mp-*")))
    server = Server(model, os.path.join(logs, f"{case}.log"), "--tensor-parallel-size", "2",
                    wait=False)
    try:
        deadline = time.monotonic() + 120  # the workers exist: the model is loading
        while time.monotonic() < deadline and len(server.children) < 3:
            server.children = psutil.Process(server.proc.pid).children(recursive=True)
            time.sleep(0.05)
        code, took = server.signal_and_wait(sig)
        report.check(case, code == want and took < 3.0,
                     f"exited with status {code} (want {want}) {took:.1f} s after {sig.name} "
                     f"(limit 3 s; "
                     f"{len(server.children)} child processes then)")
        left_behind(case, report, server)
        new = sorted(set(glob.glob(os.path.join(tempfile.gettempdir(), "kvflow-mp-*")))
                     - folders)
        report.check(case, not new, f"no executor folder left ({new})")
    finally:
        server.stop()


def long_step_case(case: str, logs: str, report: Report) -> None:
    """sigint-long-step / sigint-twice-long-step: Ctrl-C (twice) while the engine core runs a
    long prefill step."""
    twice = case == "sigint-twice-long-step"
    if not os.path.isdir(SMOLLM2_HF):
        print(f"SKIP {case}: no {SMOLLM2_HF} (python benchmarks/export_hf.py {SMOLLM2_HF})")
        return
    server = Server(SMOLLM2_HF, os.path.join(logs, f"{case}.log"), "--max-model-len", "4608",
                    "--num-kv-blocks", "320", "--max-num-batched-tokens", "4096")
    try:
        body = {"prompt": list(range(100, 4100)), "max_tokens": 1, "temperature": 0}
        start = time.monotonic()
        httpx.post(server.url + "/v1/completions", json=body, timeout=300).raise_for_status()
        print(f"{case}: the 4,000-token prefill took {time.monotonic() - start:.1f} s")
        got: dict = {}  # other tokens: no prefix of this prompt is cached
        completion_in_thread(server.url, {**body, "prompt": list(range(5000, 9000)),
                                          "user": "long"}, got)
        time.sleep(1.0)
        if twice:
            threading.Timer(0.3, server.proc.send_signal, (signal.SIGINT,)).start()
        code, took = server.signal_and_wait(signal.SIGINT)
        limit = 1.0 if twice else 3.0
        report.check(case, code == 130 and took < limit,
                     f"exited with status {code} {took:.1f} s after the first SIGINT "
                     f"(limit {limit:.0f} s)")
        shutting_down(case, report, "whole", got, False)
        left_behind(case, report, server)
    finally:
        server.stop()


def port_case(model: str, logs: str, report: Report) -> None:
    """port-in-use: another socket listens on --port."""
    case = "port-in-use"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = Server(model, os.path.join(logs, f"{case}.log"), "--host", "127.0.0.1",
                        port=port, wait=False)
        code = server.wait_exit(120)
        lines = [line for line in server.text().splitlines() if line.strip()]
        server.stop()
    report.check(case, code == 2, f"exit status {code} (want 2)")
    report.check(case, len(lines) == 1 and lines[0].startswith("kvflow: error: ") and
                 str(port) in lines[0], f"one line naming the port: {lines[:3]}")


def run_case(case: str, model: str, logs: str, report: Report) -> None:
    if case in ("sigint", "sigterm", "dp-sigint"):
        signal_case(case, model, logs, report)
    elif case == "sigint-twice":
        twice_case(model, logs, report)
    elif case in ("sigint-loading", "sigterm-loading"):
        loading_case(case, model, logs, report)
    elif case in ("sigint-long-step", "sigint-twice-long-step"):
        long_step_case(case, logs, report)
    else:
        port_case(model, logs, report)


def main() -> int:
    return run_cases(__doc__, CASES, "signals", run_case)


if __name__ == "__main__":
    sys.exit(main())
