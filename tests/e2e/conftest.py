"""Servers for the end-to-end tests: ``kvflow serve`` started as a subprocess on a free loopback
port, talked to with the official ``openai`` client and httpx.

Each test module starts its servers (module-scoped fixtures) and sends them SIGTERM when it
ends (``ServerProcess.terminate``: they shut down while the next module runs; every server is
waited for at the end of the session). A module that lists its servers in
``prestart_servers`` gets them started during one of the modules before it
(``_prestart_next_module``; the session's first module with servers in this folder gets them
started as the session starts, ``prestart_first_module``), so its start-up overlaps their
tests; its fixtures take them with
``start_server.declared(request, index)``, so each server is stated once (a server started
ahead that no test took is reported as a warning at the end of the session). The packaged
SmolLM2 server is shared by the modules that use it (``smollm2_server``).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.parent_death import with_parent_death
from tests.e2e.zygote import Zygote

START_TIMEOUT_S = 180
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # every server's
# the env of a server that serves /v1/load_lora_adapter and /v1/unload_lora_adapter
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


def load_factor() -> float:
    """How oversubscribed the CPUs are: the 1-minute load average per CPU, at least 1. A
    server's start-up is mostly CPU (about 13 s of CPU for the SmolLM2 GGUF server: two
    processes' imports, the Q4_1 weights dequantized, the GEMM weights packed; measured on the
    Ice Lake, session 53), so on a machine running several suites at once it takes that many
    times longer: a SmolLM2 start ran past a fixed 180 s at such a load. 1 where the load
    average cannot be read."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        return 1.0


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's file; its default,
    32768-60999, elsewhere)."""
    try:
        low, high = Path(EPHEMERAL_PORTS).read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now and outside the kernel's ephemeral range, for a
    server that binds it seconds later. A port the kernel hands out for port 0 comes from that
    range, which every outgoing connection's local port is also taken from: on a busy machine
    one took a server's port before it bound (``address already in use``, exit 3: every test
    of that module's shared server errored, CI session 49). Tries random ports below the range
    (else above it) until one binds."""
    low, high = _ephemeral_range()
    choices = range(10000, low) if low - 10000 >= 4096 else range(high + 1, 65536)
    for _ in range(200):
        port = random.choice(choices)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {choices}")


class ServerProcess:
    """One ``kvflow serve`` subprocess.

    Args:
        model: model argument.
        args: extra CLI flags.
        log_path: file receiving the server's stdout and stderr.
        env: extra environment variables.
        threads: torch intra-op threads of both server processes (OMP_NUM_THREADS).
        zygote: where to fork the server from (``tests/e2e/zygote.py``), when its
            environment allows; else (and without one) a new interpreter.

    Either way the server gets SIGTERM when the test process ends (the zygote's children
    when the zygote does, which ends with the test process): a run killed mid-way leaves no
    server behind (tests/e2e/parent_death.py; construct it on pytest's main thread).
    """

    def __init__(self, model: str, args: list[str], log_path: Path,
                 env: dict[str, str] | None = None, threads: int = 1,
                 zygote: Zygote | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = ["serve", model, "--host", "127.0.0.1", "--port", str(self.port),
                "--uvicorn-log-level", "warning", *args]
        full_env = {**os.environ, **SERVER_ENV, "OMP_NUM_THREADS": str(threads), **(env or {})}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        if zygote is not None and zygote.usable_for(full_env):
            self.proc = zygote.start(argv, full_env, str(log_path))
        else:
            self.proc = subprocess.Popen(
                with_parent_death([sys.executable, "-m", "kvflow.entrypoints.cli", *argv]),
                stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self._terminated = False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll /health until 200. Raises RuntimeError (with the log) if the server exits or
        does not come up in time: ``timeout`` seconds, stretched by :func:`load_factor`
        while the machine is oversubscribed."""
        start = time.monotonic()
        while time.monotonic() - start < timeout * load_factor():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {time.monotonic() - start:.0f} s "
                           f"(timeout {timeout:g} s, load factor {load_factor():.1f}):\n"
                           f"{self.log()}")

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

    def terminate(self) -> None:
        """SIGTERM (once) and return at once: the server shuts down (about 1-2 s of CPU in
        its core process) while the next tests run; :meth:`stop` waits for it, and
        ``start_server`` stops every server it started at the end of the session."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self) -> None:
        """SIGTERM (unless :meth:`terminate` sent it), then SIGKILL after 20 s; returns once
        the server has exited."""
        self.terminate()
        if self.proc.poll() is None:
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
    they come up side by side) is ready; on leaving, also when one fails to come up (its
    RuntimeError propagates), terminate them all (they shut down side by side;
    ``start_server`` waits for them at the end of the session)."""
    try:
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in servers:
            server.terminate()


class ServerStarter:
    """The ``start_server`` fixture's value: starts ``kvflow serve`` processes, hands out the
    ones started ahead for a later module (:meth:`prestart`), and stops them all at the end.

    Args:
        tmp_path_factory: where each server's log goes.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self.zygote: Zygote | None = None  # started with the first server
        self.servers: list[ServerProcess] = []
        self._ahead: dict[tuple, list[ServerProcess]] = {}
        self._shared: dict[tuple, ServerProcess] = {}
        self.prestarted_modules: set[str] = set()

    @staticmethod
    def _key(model: str, args: list[str], env: dict[str, str] | None, threads: int) -> tuple:
        return model, tuple(args), tuple(sorted((env or {}).items())), threads

    def _new(self, model: str, args: list[str], env: dict[str, str] | None,
             threads: int) -> ServerProcess:
        if self.zygote is None:
            self.zygote = Zygote({**os.environ, **SERVER_ENV})
        server = ServerProcess(model, args, self._tmp.mktemp("server") / "server.log", env,
                               threads, self.zygote)
        self.servers.append(server)
        return server

    def __call__(self, model: str, args: list[str], env: dict[str, str] | None = None,
                 threads: int = 1, wait: bool = True) -> ServerProcess:
        """A server of ``model`` with ``args``: one started ahead with exactly these
        arguments if there is one, else a new one; ready unless ``wait`` is False."""
        ahead = self._ahead.get(self._key(model, args, env, threads))
        server = ahead.pop(0) if ahead else self._new(model, args, env, threads)
        if wait:
            wait_ready_or_stop(server)
        return server

    def shared(self, model: str, args: list[str], env: dict[str, str] | None = None,
               threads: int = 1) -> ServerProcess:
        """One ready server of these arguments for the whole session, handed to every module
        that asks (modules whose tests do not need a server of their own: their requests
        leave nothing that another's assertions read); the first call starts it, or takes
        one started ahead. Not to be terminated by a module: ``stop_all`` stops it."""
        key = self._key(model, args, env, threads)
        if key not in self._shared:
            self._shared[key] = self(model, args, env, threads)
        return self._shared[key]

    def declared(self, request: pytest.FixtureRequest, index: int = 0,
                 wait: bool = True) -> ServerProcess:
        """The ``index``-th server that the requesting test module lists in its
        ``prestart_servers`` (see :func:`_prestart_next_module`), from the same declaration:
        the one started ahead for it if there is one, else a new one; ready unless ``wait``
        is False."""
        model, args, env = request.module.prestart_servers(request.getfixturevalue)[index]
        return self(model, args, env, wait=wait)

    def prestart(self, model: str, args: list[str], env: dict[str, str] | None = None,
                 threads: int = 1) -> None:
        """Start a server now, without waiting, for a later ``start_server`` call with the
        same arguments (a module's start-up overlaps the module before it); nothing when the
        session already shares a server of these arguments (:meth:`shared` returns it)."""
        key = self._key(model, args, env, threads)
        if key in self._shared:
            return
        self._ahead.setdefault(key, []).append(self._new(model, args, env, threads))

    def wait_ahead_ready(self) -> None:
        """Wait until every server started ahead and not taken yet is ready (one that fails
        to come up is left for the module that takes it: its ``wait_ready`` raises then)."""
        for ahead in self._ahead.values():
            for server in ahead:
                try:
                    server.wait_ready()
                except RuntimeError:
                    pass

    def stop_all(self, warn_unused: bool = True) -> None:
        """Terminate every server, then wait for each (they shut down side by side). With
        ``warn_unused``, warn about each server started ahead that no call took (its module's
        tests did not ask for it, or asked for a server that its declaration does not list)."""
        if warn_unused:
            for (model, args, env, threads), unused in self._ahead.items():
                for _ in unused:
                    warnings.warn(f"a server started ahead was never used: {model} {list(args)}"
                                  f" env={dict(env)} threads={threads}", stacklevel=1)
        for server in self.servers:
            server.terminate()
        for server in self.servers:
            server.stop()
        if self.zygote is not None:
            self.zygote.stop()


PRESTART_AHEAD = 2  # modules whose servers may be starting or idle ahead of their turn


def _next_prestarting_modules(session: pytest.Session, current: Any,
                              folder: Path) -> list[Any]:
    """The first ``PRESTART_AHEAD`` modules after ``current`` (None: from the session's
    start), in the session's run order and in ``folder`` (another folder's fixtures, the
    model folders among them, are not this folder's), that define ``prestart_servers``."""
    found, seen_current = [], current is None
    for item in session.items:
        module = getattr(item, "module", None)
        if module is current:
            seen_current = True
        elif (seen_current and module is not None and hasattr(module, "prestart_servers")
              and module not in found and Path(module.__file__).parent == folder):
            found.append(module)
            if len(found) == PRESTART_AHEAD:
                break
    return found


def _prestart_modules(modules: list[Any], start_server: ServerStarter,
                      fixture: Callable[[str], Any]) -> None:
    """Start the declared servers of each of ``modules`` not started yet (see
    :func:`_prestart_next_module`), without waiting."""
    for module in modules:
        if module.__name__ not in start_server.prestarted_modules:
            declared = module.prestart_servers(fixture)
            start_server.prestarted_modules.add(module.__name__)
            for model, args, env in declared:
                start_server.prestart(model, args, env)


def prestart_first_module(session: pytest.Session, start_server: ServerStarter,
                          fixture: Callable[[str], Any]) -> None:
    """Start the servers of the session's first module in this folder that declares them
    (``prestart_servers``), now: called by tests/conftest.py as the session starts, so they
    come up while the modules before this folder's run (most run on one core: the pytest
    process has one torch thread, tests/conftest.py), instead of during that module's
    set-up, where nothing before them in this folder could have started them (18.5 s of
    test_bench_serve.py's set-up in a CI rehearsal). ``fixture(name)`` gives a session
    fixture's value (those of tests/conftest.py)."""
    _prestart_modules(_next_prestarting_modules(session, None, Path(__file__).parent)[:1],
                      start_server, fixture)


@pytest.fixture(scope="module", autouse=True)
def _prestart_next_module(request: pytest.FixtureRequest, start_server: ServerStarter) -> None:
    """Start the servers of the next ``PRESTART_AHEAD`` modules that declare them (those not
    started yet), now: they come up while this module (and the next) starts its own servers
    and runs its tests, and those modules' fixtures get them ready (each ``kvflow serve``
    takes 6-20 s of mostly one core's time to start, and the tests leave the other core
    mostly idle).

    A module declares its servers with ``prestart_servers(fixture) -> [(model, args, env),
    ...]``, ``fixture(name)`` giving a session-scoped fixture's value, and its fixtures (or
    tests) take the ``i``-th with ``start_server.declared(request, i)`` (``wait=False`` to
    start several side by side), which reads the same declaration, so each server is stated
    once. A plain ``start_server(model, args, env=env)`` call with exactly the declared
    arguments also gets it (the shared ``smollm2_server``); a server started ahead that no
    call takes is only stopped, and warned about, at the end. A module that times its
    server's answers sets ``TIMING_SENSITIVE = True``: nothing is starting while it runs (it
    starts none, and first waits until every server started ahead, its own and those that
    the modules before it started for the modules after it, is ready; the module after it
    starts the next modules' servers). Off under pytest-xdist (``-n``): a worker does not
    know which module it gets next, and the other worker keeps the second core busy
    anyway."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under pytest-xdist the next module may run in another worker
    if getattr(request.module, "TIMING_SENSITIVE", False):
        start_server.wait_ahead_ready()  # nothing is starting while it runs
        return
    _prestart_modules(_next_prestarting_modules(request.session, request.module,
                                                Path(request.module.__file__).parent),
                      start_server, request.getfixturevalue)


class BuiltModels:
    """The ``built_models`` fixture's value: ``built_models(name, build)`` returns
    ``(folder, build(folder))``, built once per session (``folder`` does not exist before
    ``build`` runs), so a module's fixtures and its ``prestart_servers`` get the same model
    folder, whichever asks first.

    Args:
        tmp_path_factory: where the folders go.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._built: dict[str, tuple[str, Any]] = {}

    def __call__(self, name: str, build: Callable[[str], Any]) -> tuple[str, Any]:
        if name not in self._built:
            folder = str(self._tmp.mktemp(name) / "m")
            self._built[name] = (folder, build(folder))
        return self._built[name]

    def with_chat_template(self, name: str, src: str, template: str) -> str:
        """The model folder ``src`` copied (once per session, under ``name``) with its
        tokenizer's chat template replaced by ``template``; returns the copy's folder."""

        def build(folder: str) -> None:
            from transformers import AutoTokenizer

            shutil.copytree(src, folder)
            tokenizer = AutoTokenizer.from_pretrained(folder)
            tokenizer.chat_template = template
            tokenizer.save_pretrained(folder)

        return self(name, build)[0]


@pytest.fixture(scope="session")
def built_models(tmp_path_factory: pytest.TempPathFactory) -> BuiltModels:
    """Model folders built once per session (see :class:`BuiltModels`)."""
    return BuiltModels(tmp_path_factory)


@pytest.fixture(scope="module")
def server(start_server: ServerStarter, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """The requesting module's first declared server (``prestart_servers``), sent SIGTERM
    when the module ends. A module may define its own ``server`` instead."""
    server = start_server.declared(request)
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def free_at_start(server: ServerProcess) -> float:
    """The engine's free KV blocks before any request (every test ends back there)."""
    return server.value(server.metrics(), "kvflow:kv_cache_free_blocks")


SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_NUM_KV_BLOCKS = 64
# max_model_len: all the 63 usable blocks hold (63 x 16; block 0 is the null block)
SMOLLM2_ARGS = ["--dtype", "float32", "--num-kv-blocks", str(SMOLLM2_NUM_KV_BLOCKS),
                "--block-size", "16", "--max-model-len", "1008"]


@pytest.fixture(scope="session")
def smollm2_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """One ``kvflow serve`` of the packaged SmolLM2-135M-Instruct (float32: no bf16 near-ties;
    ``SMOLLM2_NUM_KV_BLOCKS`` blocks of 16 tokens; max_model_len 1008) for every module that
    talks to it (tests/e2e/test_openai_reported.py, test_openai_smollm.py): its start-up takes
    10-20 s. ``server.metrics_at_start`` is /metrics read once it is ready, before any request
    reached it. Stopped at the end of the session."""
    server = start_server(SMOLLM2, SMOLLM2_ARGS)
    server.metrics_at_start = server.metrics()
    return server


BERT_EMBED_ARGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "4",
                   "--served-model-name", "bert", "--max-num-batched-tokens", "64",
                   "--policy", "priority"]  # whole prompts per step; BERT has no KV cache


def bert_embed_model(tiny_tokenizer: Any, built_models: BuiltModels) -> tuple[str, Any]:
    """(folder, SentenceTransformer) of the tiny random BERT with mean pooling
    (``tests.models.embedding_models.build_bert``), built once per session."""
    from tests.models.embedding_models import build_bert

    return built_models("bert", lambda folder: build_bert(tiny_tokenizer, folder, "mean"))


@pytest.fixture(scope="session")
def bert_embed_server(start_server: ServerStarter, tiny_tokenizer: Any,
                      built_models: BuiltModels) -> ServerProcess:
    """One ``kvflow serve`` of :func:`bert_embed_model` with ``BERT_EMBED_ARGS`` (task embed,
    served as "bert", ``--policy priority``) for every module that talks to it
    (tests/e2e/test_openai_embeddings.py, test_openai_score.py); a server of these arguments
    started ahead is taken. Stopped at the end of the session."""
    return start_server(bert_embed_model(tiny_tokenizer, built_models)[0], BERT_EMBED_ARGS)


class BatchRun:
    """What ``kvflow run-batch`` run in this process left: its exit status (``cli.main``'s
    return value, the process's exit status, tests/test_cli.py), and the text it wrote to
    stdout and stderr (file descriptors 1 and 2 too: its engine-core process's)."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


_BATCH_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def run_batch_in_process(argv: list[str], stdin: str, folder: Path) -> BatchRun:
    """``kvflow run-batch`` (``argv``: what follows the command name) run by ``cli.main`` in
    this process, as the command line would, without a fresh interpreter's torch and
    transformers imports (about 3-4 s each on 2 busy cores): ``sys.stdin`` reads ``stdin``
    (a file in ``folder``; run-batch reads its file descriptor), descriptors 1 and 2 and
    ``sys.stdout`` / ``sys.stderr`` append to files there, the environment holds the flags the subprocess
    runs had (offline hub, one OpenMP thread: the engine-core process inherits them), and
    the root logger starts with no handler, so ``main``'s ``logging.basicConfig`` prints to
    that stderr as in its own process; all of it is put back after."""
    import logging

    from kvflow.entrypoints.cli import main

    paths = {name: folder / f"run_batch.{name}" for name in ("stdin", "stdout", "stderr")}
    paths["stdin"].write_text(stdin, encoding="utf-8")
    for name in ("stdout", "stderr"):
        paths[name].write_text("", encoding="utf-8")
    root, served = logging.getLogger(), logging.getLogger("kvflow.entrypoints.serving_base")
    outputs = logging.getLogger("kvflow.entrypoints.output_log")
    saved_logging = (root.handlers[:], root.level, served.level, outputs.level)
    saved_env = {key: os.environ.get(key) for key in _BATCH_ENV}
    saved_fds = {fd: os.dup(fd) for fd in (1, 2)}
    saved_streams = (sys.stdin, sys.stdout, sys.stderr)
    opened = {1: os.open(paths["stdout"], os.O_WRONLY | os.O_APPEND),
              2: os.open(paths["stderr"], os.O_WRONLY | os.O_APPEND)}
    given = open(paths["stdin"], "rb")  # noqa: SIM115
    out = open(paths["stdout"], "a", encoding="utf-8", buffering=1)  # noqa: SIM115
    err = open(paths["stderr"], "a", encoding="utf-8", buffering=1)  # noqa: SIM115
    try:
        os.environ.update(_BATCH_ENV)
        for fd, target in opened.items():
            os.dup2(target, fd)
        sys.stdin, sys.stdout, sys.stderr = given, out, err  # run-batch reads stdin's fileno()
        root.handlers = []
        status = main(["run-batch", *argv])
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        for handler in root.handlers:
            handler.close()
        root.handlers = saved_logging[0]
        root.setLevel(saved_logging[1])
        served.setLevel(saved_logging[2])
        outputs.setLevel(saved_logging[3])
        for fd, saved in saved_fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        for fd in opened.values():
            os.close(fd)
        given.close()
        out.close()
        err.close()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return BatchRun(status, paths["stdout"].read_text(encoding="utf-8"),
                    paths["stderr"].read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def run_batch_here() -> Callable[[list[str], str, Path], BatchRun]:
    """:func:`run_batch_in_process`, for the run-batch test modules."""
    return run_batch_in_process
