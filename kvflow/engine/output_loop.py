"""The server's output loop: one asyncio task in the API process that receives every message the
engine-core replicas push to their shared output socket and hands it on (outputs and stats to
the open requests and the metrics, admission verdicts, LoRA call answers, a restarted replica's
``EngineReady``), and that ends a replica's open work when it fails (``EngineFailed``), its
process exits, or it sends no heartbeat for ``engine_heartbeat_timeout`` seconds (stopped or
frozen: it is killed; ``kvflow/engine/core_heartbeat.py``), checked every ``_POLL_MS`` (or a
quarter of that timeout, if shorter), even while other replicas keep talking.

What a lost replica means for the whole engine (new requests refused once none is left, the
server told through ``AsyncLLM.on_dead``) is ``AsyncLLM``'s: the loop calls back. Used on the
event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq.asyncio

from kvflow.engine.core_client import ReplicaState
from kvflow.engine.core_heartbeat import CoreLiveness
from kvflow.engine.messages import (
    AbortRequests,
    AdmissionVerdicts,
    EngineFailed,
    EngineHeartbeat,
    EngineOutputs,
    EngineReady,
    UtilityResult,
)
from kvflow.engine.open_requests import OpenRequests
from kvflow.engine.replica_restarts import ReplicaRestarts
from kvflow.engine.replica_set import ReplicaSet
from kvflow.engine.streams import EngineDeadError
from kvflow.engine.utility_calls import UtilityCalls
from kvflow.engine_outputs import EngineStats
from kvflow.metrics.server import ServerMetrics

logger = logging.getLogger(__name__)

_POLL_MS = 1000  # how often the output loop checks that the core processes are alive


class OutputLoop:
    """The task reading the replicas' messages: the constructor starts it on the running event
    loop, :meth:`stop` ends it.

    Args:
        replicas: the replicas (their shared output socket is read; their cores' states say
            which are live).
        requests: the open requests (outputs and admission verdicts go there; a lost
            replica's fail).
        calls: the LoRA calls awaiting answers.
        restarts: the restarts in progress (a replica lost while restarting ends its own).
        stats: each replica's latest ``EngineStats``, by index (updated in place).
        metrics: where the engine stats are recorded.
        on_ready: called with the ``EngineReady`` of a replica that (re)started.
        is_healthy: whether the engine takes requests (for the log line of a lost replica).
        on_lost: called with ``(error, was_live)`` once a lost replica's requests and calls
            have failed (``was_live`` is False when it was a restart that failed).
        on_broken: called with the exception when the loop itself failed (it has ended).
    """

    def __init__(self, replicas: ReplicaSet, requests: OpenRequests, calls: UtilityCalls,
                 restarts: ReplicaRestarts, stats: list[EngineStats], metrics: ServerMetrics,
                 on_ready: Callable[[EngineReady], None], is_healthy: Callable[[], bool],
                 on_lost: Callable[[EngineDeadError, bool], None],
                 on_broken: Callable[[Exception], None]) -> None:
        self.replicas, self.requests, self.calls = replicas, requests, calls
        self.restarts, self.stats, self.metrics = restarts, stats, metrics
        self.on_ready, self.is_healthy = on_ready, is_healthy
        self.on_lost, self.on_broken = on_lost, on_broken
        self.socket = zmq.asyncio.Socket.from_socket(replicas.output)
        self.liveness = CoreLiveness(replicas.num_replicas,
                                     replicas.config.parallel_config.engine_heartbeat_timeout,
                                     time.monotonic())
        self._check_s = min(_POLL_MS / 1000, self.liveness.check_interval_s)
        self._poll_ms = max(1, round(self._check_s * 1000))
        self._task: asyncio.Task | None = asyncio.create_task(self._run(),
                                                              name="kvflow-outputs")

    async def stop(self) -> None:
        """Cancel the task and wait for it to end (idempotent); ``socket`` stays open (the
        replicas' ``close`` releases it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        next_check = 0.0
        while True:
            try:
                if time.monotonic() >= next_check:  # even while other replicas keep talking
                    self._check_processes()
                    next_check = time.monotonic() + self._check_s
                # poll only until the next check is due: a message just before it would
                # otherwise put up to two intervals between checks, and one longer than half
                # the heartbeat timeout forgives every silence (CoreLiveness)
                wait_ms = round((next_check - time.monotonic()) * 1000)
                if not await self.socket.poll(max(1, min(self._poll_ms, wait_ms))):
                    continue
                msg = self.replicas.decoder.decode(await self.socket.recv())
                if isinstance(msg, EngineOutputs):
                    self._handle_outputs(msg)
                elif isinstance(msg, EngineHeartbeat):
                    self.liveness.beat(msg)
                elif isinstance(msg, EngineFailed):
                    self._replica_died(msg.engine_index, EngineDeadError(
                        f"{self.replicas.name(msg.engine_index)} failed: {msg.message}"),
                        "failed")
                elif isinstance(msg, EngineReady):
                    self.liveness.heard(msg.engine_index, time.monotonic())
                    self.on_ready(msg)
                elif isinstance(msg, AdmissionVerdicts):
                    self.requests.settle(msg)
                elif isinstance(msg, UtilityResult):
                    self.calls.answer(msg)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the loop itself broke: end every request
                logger.exception("output loop failed")
                self.on_broken(e)
                return

    def _check_processes(self) -> None:
        """End the replicas whose process exited, then those alive but silent (killed)."""
        for core in self.replicas.exited():
            self._replica_died(core.index, EngineDeadError(
                f"{self.replicas.name(core.index)} process exited with code "
                f"{core.proc.exitcode}"), "exited")
        for core, silent_s in self.liveness.silent(self.replicas.cores, time.monotonic()):
            why = self.liveness.declare_dead(core, silent_s, self.replicas.name(core.index))
            self._replica_died(core.index, EngineDeadError(f"{why}; killed it"),
                               "unresponsive")

    def _replica_died(self, index: int, error: EngineDeadError, reason: str) -> None:
        """Fail the replica's open requests, stop routing to it, count a live one lost while
        serving in the metrics (``reason``: "failed", "exited" or "unresponsive"), tell
        ``on_lost``."""
        core = self.replicas.cores[index]
        if core.state is ReplicaState.DEAD:
            return
        was_live = core.state is ReplicaState.LIVE  # else a restart failed: restart() says so
        core.state, core.death = ReplicaState.DEAD, error
        balancer = self.requests.balancer
        failed = balancer.requests_on(index)
        balancer.forget_replica(index)
        self.metrics.reset_engine(index)
        if was_live and not self.replicas.stopping:  # not a failed restart, nor a shutdown
            self.metrics.record_engine_lost(index, reason)
        logger.log(logging.INFO if self.replicas.stopping else logging.ERROR,  # a shutdown's
                   "%s lost (%s): ending its %d open requests with an error%s",
                   self.replicas.name(index), error, len(failed),
                   "" if self.is_healthy() else "; new requests get 503")
        for request_id in failed:
            self.requests.fail(request_id, error)
        self.calls.fail(error, index)
        self.restarts.died(index)  # a restart that failed, if one was running
        self.on_lost(error, was_live)

    def _handle_outputs(self, msg: EngineOutputs) -> None:
        self.stats[msg.engine_index] = msg.stats
        self.metrics.record_engine_stats(msg.stats, msg.engine_index)
        stopped, refused = self.requests.deliver(msg)
        if stopped:  # stop strings matched: free their KV blocks now
            self.replicas.send(msg.engine_index, AbortRequests(stopped, stopped=True))
        if refused:  # the other samples of requests the core refused
            self.replicas.send(msg.engine_index, AbortRequests(refused))
