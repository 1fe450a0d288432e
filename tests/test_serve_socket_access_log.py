"""vLLM's ``--uds``, ``--disable-uvicorn-access-log`` and ``--disable-access-log-for-endpoints``
on ``kvflow serve``: the app ``build_app`` makes over a stand-in engine (the open routes used
here never reach it), served by uvicorn with the options ``uvicorn_options`` derives, on a
Unix domain socket reached through httpx's UDS transport; the access log lines that reach
the ``uvicorn.access`` logger's handlers are recorded and compared with the paths asked."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.access_log import AccessLogPathFilter, excluded_paths
from kvflow.entrypoints.api_server import build_app, check_socket_path
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.config_file import expand_config_file
from kvflow.entrypoints.http_options import uvicorn_options


def _config(*argv: str) -> ServerConfig:
    return ServerConfig.from_cli_args(build_parser().parse_args(["serve", *argv]), env={})


def _access_lines(out: str) -> list[str]:
    """The request targets (path and query) of uvicorn's access lines in ``out`` (its
    access handler writes to stdout), in order."""
    return [line.split('"')[1].split()[1] for line in out.splitlines() if ' - "GET ' in line]


@contextmanager
def _serving(config: ServerConfig) -> Iterator[httpx.Client]:
    """uvicorn serving the app on ``config.uds`` in a thread (its log configured while the
    test's stdout is captured); a client on that socket."""
    engine = SimpleNamespace(config=EngineConfig(), is_healthy=True)
    app = build_app(engine, config, "m")
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="info",
                                           **uvicorn_options(config)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        with httpx.Client(transport=httpx.HTTPTransport(uds=config.uds),
                          base_url="http://kvflow", timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(20)


def _ask(client: httpx.Client) -> list[int]:
    return [client.get(path).status_code for path in ("/health", "/version?x=1", "/ping",
                                                      "/health?probe=1")]


@pytest.fixture
def socket_path(tmp_path) -> str:
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path can be longer
    path = f"/tmp/kvflow-uds-{os.getpid()}-{tmp_path.name[-20:]}.sock"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def test_uds_serves_and_logs_every_path(socket_path, capsys):
    config = _config("--uds", socket_path)
    assert config.uds == socket_path and uvicorn_options(config) == {"uds": socket_path}
    with _serving(config) as client:
        assert _ask(client) == [200, 200, 200, 200]
        assert client.get("/version").json()["version"]
    assert _access_lines(capsys.readouterr().out) == ["/health", "/version?x=1", "/ping", "/health?probe=1",
                             "/version"]


def test_access_log_left_out_for_the_listed_paths(socket_path, capsys):
    config = _config("--uds", socket_path, "--disable-access-log-for-endpoints",
                     " /health, /ping ,")
    with _serving(config) as client:
        assert _ask(client) == [200, 200, 200, 200]
    assert _access_lines(capsys.readouterr().out) == ["/version?x=1"]  # /health?probe=1 is /health: left out too


def test_no_access_log_at_all(socket_path, capsys):
    config = _config("--uds", socket_path, "--disable-uvicorn-access-log")
    assert uvicorn_options(config) == {"uds": socket_path, "access_log": False}
    with _serving(config) as client:
        assert _ask(client) == [200, 200, 200, 200]
    out = capsys.readouterr().out
    assert _access_lines(out) == [] and "GET" not in out


def test_path_filter_alone():
    """vLLM's matching: the exact path, the query string left off; other loggers pass."""
    keep = AccessLogPathFilter(["/metrics"])

    def record(name: str, target: str) -> logging.LogRecord:
        return logging.LogRecord(name, logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("1.2.3.4:5", "GET", target, "1.1", 200), None)
    assert not keep.filter(record("uvicorn.access", "/metrics?a=b"))
    assert keep.filter(record("uvicorn.access", "/metrics/x"))
    assert keep.filter(record("uvicorn.error", "/metrics"))
    assert excluded_paths(None) == () and excluded_paths("/a,,/b ") == ("/a", "/b")


def test_in_a_config_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("uds: /tmp/k.sock\ndisable-uvicorn-access-log: true\n"
                    "disable_access_log_for_endpoints: /health,/metrics\n")
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["serve", "--config", str(path)]))
    config = ServerConfig.from_cli_args(args, env={})
    assert (config.uds, config.disable_uvicorn_access_log) == ("/tmp/k.sock", True)
    assert config.disable_access_log_for_endpoints == "/health,/metrics"


def test_socket_path_checked_before_the_model_loads(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="does not exist"):
        check_socket_path(str(tmp_path / "none" / "s.sock"))
    with pytest.raises(ValueError, match="not a socket"):
        check_socket_path(str(tmp_path / "file"))
    check_socket_path(str(tmp_path / "new.sock"))  # a new path in a folder that exists
    from kvflow.engine import async_llm

    def no_engine(*args, **kw):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_engine)
    rc = main(["serve", "SmolLM2-135M-Instruct", "--uds", str(tmp_path / "file")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "not a socket" in err[0], err
