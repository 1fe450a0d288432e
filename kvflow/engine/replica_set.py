"""The engine-core replicas seen from the API process: a private IPC directory, one ZMQ
context, the output socket that every replica pushes to, and one ``CoreProcess`` per
data-parallel replica (one without data parallelism).

``AsyncLLM`` (the server) and ``DPCoreClient`` (the offline ``LLM`` with
``data_parallel_size > 1``) both talk to their replicas through one ``ReplicaSet``; what they
do with the messages that come back is their own.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import msgspec
import zmq

from kvflow.config import EngineConfig
from kvflow.engine.core_client import (
    STEP_GRACE_S,
    CoreProcess,
    ReplicaState,
    replica_config,
    replica_name,
    start_ray_for_replicas,
    stop_ray,
    wait_ready,
)
from kvflow.engine.core_process_setup import import_config_modules
from kvflow.engine.messages import EngineReady, Shutdown, output_decoder
from kvflow.engine.start_method import core_start_method, method_now, restart_method


class ReplicaSet:
    """The IPC endpoints and core processes of ``config.parallel_config.data_parallel_size``
    replicas. Nothing starts until :meth:`start`; :meth:`close` releases everything.

    Args:
        config: the engine configuration (replica ``i`` runs it with ``data_parallel_rank=i``).
        prefix: the name prefix of the private IPC directory.
        start_method: how :meth:`start` starts the core processes, ``"spawn"``, ``"fork"`` or
            ``"forkserver"``; None (the default): ``core_start_method(fresh_process=False)``
            (``kvflow/engine/start_method.py``: the forkserver on Linux unless
            ``KVFLOW_WORKER_MULTIPROC_METHOD`` says otherwise). :meth:`respawn` starts a core
            the same way, but spawns where the first ones were forked
            (``start_method.restart_method``).

    Raises:
        ValueError: from the constructor, for a bad ``KVFLOW_WORKER_MULTIPROC_METHOD`` (with
            ``start_method=None``).

    Attributes:
        output: the PULL socket every replica's core pushes its messages to (bound here).
        encoder, decoder: msgpack encoder of inputs, decoder of the cores' messages.
        cores: one ``CoreProcess`` per replica, by index.
        hurry: True once the caller wants no waiting (a second Ctrl-C): ``close`` then sends
            a core still in its step SIGTERM at once instead of after ``STEP_GRACE_S``.
        stopping: True once the caller is shutting down (a signal reached the server): a
            replica ending from then on is part of it (the output loop logs it at INFO).
    """

    def __init__(self, config: EngineConfig, prefix: str = "kvflow-",
                 start_method: str | None = None) -> None:
        self.config = config
        self.start_method = core_start_method(False) if start_method is None else start_method
        self.num_replicas = config.parallel_config.data_parallel_size
        self.ipc_dir = tempfile.mkdtemp(prefix=prefix)
        self.ctx = zmq.Context()
        self.output_addr = f"ipc://{os.path.join(self.ipc_dir, 'output')}"
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.bind(self.output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = output_decoder()
        self.cores: list[CoreProcess] = []
        self.hurry = False
        self.stopping = False
        self._go = None  # the start gate of start(gated=True)
        self._started_ray = False  # start() started the replicas' Ray cluster

    def start(self, gated: bool = False) -> None:
        """Start one core process per replica (they load the model on their own; ``gated``:
        only once :meth:`release` is called, so that the caller can check the model's
        config.json while the processes import the engine). Replicas under the ``ray``
        backend share one Ray cluster, started here when none is named or connected
        (``core_client.start_ray_for_replicas``; :meth:`close` stops it).

        Raises:
            ValueError: for the ``ray`` backend without Ray installed.
        """
        self._started_ray = start_ray_for_replicas(self.config)
        go = os.path.join(self.ipc_dir, "go") if gated else None  # a file: no semaphores
        self._go = go
        if gated and method_now(self.start_method) == "fork":  # the caller's config check
            import_config_modules()  # needs them next: imported once, and the cores inherit
        for index in range(self.num_replicas):
            self.cores.append(CoreProcess(self.ctx, self.ipc_dir,
                                          replica_config(self.config, index),
                                          self.output_addr))
            self.cores[index].start(_log_level(), go, method_now(self.start_method))

    def release(self) -> None:
        """Let cores started ``gated`` load the model (no-op otherwise)."""
        if self._go is not None:
            open(self._go, "w").close()

    def wait_ready(self, timeout: float,
                   on_ready: Callable[[EngineReady], None] | None = None) -> dict[int, EngineReady]:
        """Block until every replica reported ``EngineReady`` (each marked live, then
        passed to ``on_ready``); returns their messages by replica index.

        Raises:
            RuntimeError: naming the replica, if one fails, exceeds ``timeout`` seconds, or
                sends no heartbeat for ``engine_heartbeat_timeout`` seconds (stopped or
                frozen while it loads: it is killed).
        """
        return wait_ready(self.output, self.decoder, self.cores, timeout, on_ready,
                          self.config.parallel_config.engine_heartbeat_timeout)

    def name(self, index: int) -> str:
        """How logs and errors name replica ``index`` ("the engine core" without DP)."""
        return replica_name(index, self.num_replicas)

    def respawn(self, index: int) -> CoreProcess:
        """Stop replica ``index``'s process and start a new one in its place (same config,
        next generation); returns the new one."""
        old = self.cores[index]
        old.stop(self.encoder.encode(Shutdown()))
        core = CoreProcess(self.ctx, self.ipc_dir, old.config, self.output_addr,
                           old.generation + 1)
        self.cores[index] = core
        core.start(_log_level(), method=method_now(restart_method(self.start_method)))
        return core

    def send(self, index: int, msg: msgspec.Struct) -> None:
        """Send ``msg`` to replica ``index`` unless it is dead or its socket is closed."""
        core = self.cores[index]
        if core.state is not ReplicaState.DEAD and not core.input.closed:
            core.send(self.encoder.encode(msg))

    def exited(self) -> list[CoreProcess]:
        """The replicas not yet marked dead whose process has exited."""
        return [c for c in self.cores if c.state is not ReplicaState.DEAD and not c.is_alive]

    def close(self, *sockets: zmq.Socket | None) -> None:
        """Ask every core to stop, then make sure each does; close ``sockets`` (views of
        ``output``) and the output socket, the context and the IPC directory. Idempotent.
        The cores share one ``STEP_GRACE_S`` (all asked at once): replicas all in long steps
        get SIGTERM after 1 s, not 1 s each in turn."""
        shutdown = self.encoder.encode(Shutdown())
        for core in self.cores:  # all stop at once, then each is waited for
            core.ask_to_stop(shutdown)
        grace_end = time.monotonic() + STEP_GRACE_S
        for core in self.cores:
            core.stop(shutdown, lambda: self.hurry or time.monotonic() >= grace_end)
        for sock in (*sockets, self.output):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        if not self.ctx.closed:
            self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if self._started_ray:
            self._started_ray = False
            stop_ray()


def _log_level() -> int:
    return logging.getLogger("kvflow").getEffectiveLevel()
