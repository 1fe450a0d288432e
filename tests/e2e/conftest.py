"""Servers for the end-to-end tests: ``kvflow serve`` started as a subprocess on a free loopback
port, talked to with the official ``openai`` client and httpx.

Each test module starts one server (module-scoped fixture) and stops it with SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

# A tiny chat template: "<user>hi\n<assistant>".
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")
START_TIMEOUT_S = 180


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free (bind to port 0, read it, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``kvflow serve`` subprocess.

    Args:
        model: model argument.
        args: extra CLI flags.
        log_path: file receiving the server's stdout and stderr.
        env: extra environment variables.
        threads: torch intra-op threads of both server processes (OMP_NUM_THREADS).
    """

    def __init__(self, model: str, args: list[str], log_path: Path,
                 env: dict[str, str] | None = None, threads: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", model,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--uvicorn-log-level", "warning", *args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "OMP_NUM_THREADS": str(threads), **(env or {})}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll /health until 200. Raises RuntimeError (with the log) if the server exits or
        does not come up in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=120, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """GET /metrics, parsed by prometheus_client: {(sample name, sorted labels): value}."""
        resp = httpx.get(f"{self.url}/metrics", timeout=10)
        resp.raise_for_status()
        out = {}
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                      if k != "model_name"))
                out[(sample.name, labels)] = sample.value
        return out

    @staticmethod
    def value(metrics: dict, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` in ``metrics()`` output that carry ``labels``
        (among others: an engine-state series summed over its ``engine`` replicas); 0 when
        there is none."""
        wanted = set(labels.items())
        return sum(v for (sample, sample_labels), v in metrics.items()
                   if sample == name and wanted <= set(sample_labels))

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s; fails the caller if the server does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def post_at_once(url: str, body: dict[str, Any], count: int) -> list[httpx.Response]:
    """POST ``body`` to ``url`` from ``count`` threads released together (a burst: the first
    request to reach the engine finds it idle, the others find it busy with the first)."""
    barrier, responses = threading.Barrier(count), [None] * count

    def send(i: int) -> None:
        barrier.wait()
        responses[i] = httpx.post(url, json=body, timeout=60)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return responses


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_llama: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama copied to a folder of its own with a chat template added; returns it."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny_chat") / "model"
    shutil.copytree(tiny_llama.path, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


def wait_ready_or_stop(server: ServerProcess) -> None:
    """``server.wait_ready()``; a server that fails to come up is stopped before the
    RuntimeError propagates."""
    try:
        server.wait_ready()
    except RuntimeError:
        server.stop()
        raise


@contextmanager
def ready_side_by_side(*servers: ServerProcess) -> Iterator[None]:
    """Wait until each of ``servers`` (started with ``start_server(..., wait=False)``, so that
    they come up side by side) is ready; stop them all on leaving, also when one fails to
    come up (its RuntimeError propagates)."""
    try:
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(model, args, env=None, threads=1, wait=True)`` -> a ready ServerProcess;
    every server started is stopped at the end of the session (modules may stop theirs
    earlier). ``wait=False`` returns it starting: the caller starts others (they come up side
    by side) and waits with :func:`ready_side_by_side` (or :func:`wait_ready_or_stop`)."""
    servers: list[ServerProcess] = []

    def start(model: str, args: list[str], env: dict[str, str] | None = None,
              threads: int = 1, wait: bool = True) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(model, args, log, env, threads)
        servers.append(server)
        if wait:
            wait_ready_or_stop(server)
        return server

    yield start
    for server in servers:
        server.stop()

