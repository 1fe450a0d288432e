"""The engine-core process's start gate (``engine/core_process_setup.py: wait_for_go``): the
server starts its core processes before it has checked config.json, so that their imports overlap
the check; a core loads nothing until it is let go, and gives up on ``Shutdown``."""

from __future__ import annotations

import threading

import zmq

from kvflow.engine.core_process_setup import wait_for_go
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



_WAITS = """
import sys, threading, zmq
from pathlib import Path
from kvflow.engine.core_process_setup import wait_for_go
AUTO = "transformers.models.auto.configuration_auto"
go = Path(sys.argv[1])
ctx = zmq.Context(); pull = ctx.socket(zmq.PULL); pull.bind("inproc://gate")
before = AUTO in sys.modules
threading.Timer(0.1, go.touch).start()  # the API process's config check took 0.1 s
print(before, wait_for_go(str(go), pull), AUTO in sys.modules)
pull.close(0); ctx.term()
"""


def test_the_waiting_core_imports_autoconfig_before_the_go(tmp_path):
    """While the API process checks config.json, the waiting core imports AutoConfig's module
    (and with it transformers.models' lazy index: 1.9-3.4 s on 2 busy cores, which it spent
    after the go before, on the way to /health); in a fresh interpreter, as a core's is."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", _WAITS, str(tmp_path / "go")], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "True", "True"]  # before: False True False


_STARTS = """
import sys
from kvflow.config import EngineConfig
from kvflow.engine import replica_set
AUTO = "transformers.models.auto.configuration_auto"
seen = []  # (method, AutoConfig's module imported) as each core would start
replica_set.CoreProcess.start = lambda self, level, go, method: seen.append(
    (method, AUTO in sys.modules))
config = EngineConfig.from_kwargs(model=sys.argv[1], dtype="float32")
before = AUTO in sys.modules
replicas = replica_set.ReplicaSet(config, start_method=sys.argv[2])
replicas.start(gated=True)
replicas.cores.clear()
replicas.close()
print(before, *seen[0])
"""


def test_a_forking_api_process_imports_autoconfig_once_before_the_fork(tmp_path, tiny_llama):
    """A core about to be forked inherits AutoConfig's modules, which the API process's config
    check imports next anyway (was: the API process and the waiting core imported them at the
    same time, on the same 2 cores); a spawned core imports its own, so spawning waits for
    nothing. In a fresh interpreter, as ``kvflow serve``'s is."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1")
    outs = [subprocess.run([sys.executable, "-c", _STARTS, tiny_llama.path, method], env=env,
                           capture_output=True, text=True, timeout=120, check=True).stdout
            for method in ("fork", "spawn")]
    assert [out.split() for out in outs] == [["False", "fork", "True"],  # before: False
                                             ["False", "spawn", "False"]]
