"""The engine-core process's start gate (``engine/core_proc.py: wait_for_go``): the server
starts its core processes before it has checked config.json, so that their imports overlap the
check; a core loads nothing until it is let go, and gives up on ``Shutdown``."""

from __future__ import annotations

import threading

import zmq

from kvflow.engine.core_proc import wait_for_go
from kvflow.engine.messages import Shutdown


def _pair() -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://gate")
    push.connect("inproc://gate")
    return ctx, push, pull


def test_go_created_later_lets_the_core_load(tmp_path):
    ctx, push, pull = _pair()
    go = tmp_path / "go"
    timer = threading.Timer(0.1, go.touch)
    timer.start()
    try:
        assert wait_for_go(str(go), pull) is True
        assert go.exists()
    finally:
        timer.cancel()
        push.close(0), pull.close(0), ctx.term()


def test_shutdown_before_go_ends_the_wait_without_loading(tmp_path):
    import msgspec

    ctx, push, pull = _pair()
    go = tmp_path / "go"
    push.send(msgspec.msgpack.encode(Shutdown()))
    try:
        assert wait_for_go(str(go), pull) is False
        assert not go.exists()
    finally:
        push.close(0), pull.close(0), ctx.term()
