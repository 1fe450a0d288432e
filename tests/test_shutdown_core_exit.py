"""SIGTERM to the server and its engine core at once (``pkill -f "kvflow serve"``: a forked core
has the server's command line; a systemd stop signals the whole group): the core may end
before the server's shutdown aborts its requests. Found in session 41's newcomer trial: 4 of
11 such stops ended with a ``zmq.error.Again`` traceback and exit status 1, the others logged
"engine core died" at ERROR and, under ``--engine-failure restart``, started a new core while
shutting down. tests/e2e/test_engine_faults.py::test_sigterm_aborts_open_requests sends both
signals to a real server."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import zmq

from kvflow.config import EngineConfig, ServerConfig
from kvflow.engine.core_client import CoreProcess, ReplicaState
from kvflow.engine.output_loop import OutputLoop
from kvflow.entrypoints import api_server


def test_a_message_to_a_core_that_is_gone_is_dropped(tmp_path):
    """No process ever connects to this core's socket, as none is left once a core has ended:
    zmq refuses the send (``zmq.Again``, checked on the raw socket first) and ``send``
    drops the message instead of raising it."""
    ctx = zmq.Context()
    core = CoreProcess(ctx, str(tmp_path), EngineConfig(), f"ipc://{tmp_path}/output")
    try:
        try:
            core.input.send(b"probe", flags=zmq.NOBLOCK)
            raised = False
        except zmq.Again:
            raised = True
        assert raised  # the oracle: what the socket itself does without a peer
        core.send(b"abort")  # returns
    finally:
        core.input.close(linger=0)
        ctx.term()


def _app(stopping: bool, engine_failure: str) -> SimpleNamespace:
    """A stand-in app whose engine has had ``begin_shutdown`` called (``stopping``) or not."""
    calls = []
    engine = SimpleNamespace(fail_all=lambda error: calls.append(("fail_all", str(error))),
                             is_stopping=stopping)
    engine.begin_shutdown = lambda: setattr(engine, "is_stopping", True)
    state = SimpleNamespace(config=ServerConfig(engine_failure=engine_failure), engine=engine,
                            uvicorn_server=SimpleNamespace(should_exit=False), calls=calls)
    return SimpleNamespace(state=state)


def test_a_core_ending_during_shutdown_is_neither_an_error_nor_restarted(caplog):
    for policy in ("restart", "exit"):
        app = _app(stopping=True, engine_failure=policy)
        with caplog.at_level(logging.INFO, logger="kvflow"):
            caplog.clear()
            api_server._on_engine_dead(app, RuntimeError("engine core process exited with "
                                                         "code 143"))
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", ("engine core exited while the server shuts down (engine core process "
                      "exited with code 143)"))]
        assert app.state.calls == [] and not hasattr(app.state, "restart_task")
        assert not getattr(app.state, "engine_died", False)  # ends by the signal, not 1


def test_a_core_dying_while_serving_still_ends_the_server(caplog):
    """The guard is only for a shutdown in progress: ``--engine-failure exit`` still logs the
    death at ERROR, fails the open requests and ends the server with status 1."""
    app = _app(stopping=False, engine_failure="exit")
    with caplog.at_level(logging.INFO, logger="kvflow"):
        api_server._on_engine_dead(app, RuntimeError("killed"))
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert app.state.calls == [("fail_all", "killed")]
    assert app.state.engine_died and app.state.uvicorn_server.should_exit
    assert app.state.engine.is_stopping  # a second replica's end is then part of the stop


def _lost_log_level(stopping: bool, caplog) -> list[str]:
    """The level of the output loop's line for a lost replica (``OutputLoop._replica_died``
    on stand-ins for its collaborators)."""
    failed = []
    core = SimpleNamespace(state=ReplicaState.LIVE, death=None)
    loop = SimpleNamespace(
        replicas=SimpleNamespace(cores=[core], stopping=stopping, name=lambda i: "the engine core"),
        requests=SimpleNamespace(balancer=SimpleNamespace(requests_on=lambda i: ["r1"],
                                                          forget_replica=lambda i: None),
                                 fail=lambda rid, error: failed.append(rid)),
        metrics=SimpleNamespace(reset_engine=lambda i: None,
                                record_engine_lost=lambda i, reason: None),
        is_healthy=lambda: False,
        calls=SimpleNamespace(fail=lambda error, i: None),
        restarts=SimpleNamespace(died=lambda i: None), on_lost=lambda error, live: None)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        caplog.clear()
        OutputLoop._replica_died(loop, 0, RuntimeError("exited with code 143"), "exited")
    assert failed == ["r1"] and core.state is ReplicaState.DEAD
    return [r.levelname for r in caplog.records]


def test_a_replica_lost_during_shutdown_is_logged_at_info(caplog):
    """``AsyncLLM.begin_shutdown`` (the server's signal handler) sets ``stopping``: the lost
    replica's line is INFO then, ERROR otherwise; its requests fail either way."""
    assert _lost_log_level(stopping=True, caplog=caplog) == ["INFO"]
    assert _lost_log_level(stopping=False, caplog=caplog) == ["ERROR"]
