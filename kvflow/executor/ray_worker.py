"""The Ray actor that hosts one rank's :class:`~kvflow.worker.worker.Worker`.

:class:`kvflow.executor.ray.RayExecutor` wraps this class with ``ray.remote`` and creates one
actor per rank in a placement group. The actor starts empty (so the executor can ask it for its
node and a free port first), then ``init_worker`` builds the Worker; afterwards it serves the
same calls as the multiprocess worker: ``execute_model`` with a msgspec-encoded step (the
driver rank returns the encoded result, the others None) and ``rpc`` for everything else.
Once its Worker is built, a thread sends a heartbeat every second to the executor over TCP
(:mod:`kvflow.executor.heartbeat`, as the ``mp`` workers do), so the executor finds an actor
that is alive but does not run (SIGSTOP, a debugger), which Ray itself does not.
Ray runs an actor's calls one at a time in submission order, so pipelined steps stay in order.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from kvflow.executor.heartbeat import HEARTBEAT_INTERVAL_S, HeartbeatSender
from kvflow.executor.step_codec import StepCodec
from kvflow.worker.worker import Worker


def free_port() -> int:
    """A TCP port that was free on this machine a moment ago (bound to port 0, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayWorkerWrapper:
    """One rank inside a Ray actor (the executor calls ``init_worker`` before anything else)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.codec: StepCodec | None = None
        self.heartbeat: HeartbeatSender | None = None

    def node_address(self) -> tuple[str, int]:
        """(this node's IP address, a free TCP port on it): the rendezvous of rank 0."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def getpid(self) -> int:
        """This actor's process id (also the executor's health ping: ``check_health``)."""
        return os.getpid()

    def whereabouts(self) -> tuple[str, int]:
        """(this actor's Ray node id, its process id): the executor reads the process state
        of a silent actor on its own node (``/proc``)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def init_worker(self, rank: int, distributed_init_method: str, config: Any, source: Any,
                    hf_config: Any, dtype: Any, heartbeat_addr: str | None = None,
                    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Build this rank's Worker (joins the process group: call on every rank at once),
        then start its heartbeat thread, PUSHing to the executor's ``heartbeat_addr``
        (``tcp://...``; None: no heartbeats) every ``heartbeat_interval_s`` seconds. Ray
        gives each actor its own device, so the local device index is always 0."""
        self.codec = StepCodec()
        self.worker = Worker(config, rank, 0, distributed_init_method, source, hf_config, dtype)
        if heartbeat_addr is not None:
            self.heartbeat = HeartbeatSender(rank, heartbeat_addr, heartbeat_interval_s)
            self.heartbeat.start()

    def rpc(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def execute_model(self, payload: bytes) -> bytes | None:
        """One step; the msgspec-encoded result on the driver rank, None elsewhere."""
        sched, bitmask = self.codec.decode_step(payload)
        result = self.worker.execute_model(sched, bitmask)
        return self.codec.encode(result) if self.worker.is_driver else None

    def shutdown(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.worker is not None:
            self.worker.shutdown()
