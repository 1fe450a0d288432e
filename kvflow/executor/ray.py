"""Ray executor: one Ray actor per rank, for engines that span several machines.

``--distributed-executor-backend ray`` (``pip install 'kvflow[ray]'``). The executor joins the
Ray cluster named by ``RAY_ADDRESS`` (or one already initialized in this process), else starts
a local one; reserves one bundle per rank in a placement group (``{"GPU": 1}`` on CUDA,
``{"CPU": 1}`` on CPU; packed, so a TP group lands on one machine where it fits); starts one
:class:`~kvflow.executor.ray_worker.RayWorkerWrapper` actor per bundle; and has them join
torch.distributed at rank 0's node address on a port picked free there. Every rank runs the
same Worker code as with ``mp``.

A step is encoded once, put in Ray's object store once, and its reference passed to every
actor; only the driver rank's result is decoded. A failed actor (dead, or raised) ends the
wait for its step with :class:`~kvflow.executor.base.ExecutorError` naming the rank (a rank
whose actor died, rather than the peers whose collective its death broke), and every actor is
killed. As with ``mp``, a worker's ``ValueError`` before the first step (building its
part of the model, sizing or allocating its KV cache) is bad input:
:class:`~kvflow.executor.base.WorkerConfigError`, one line from ``kvflow`` (exit 2).

An actor that is alive but does not run (SIGSTOP, a debugger) is not a death to Ray, and its
peers would wait in their collective up to torch.distributed's timeout (600 s). So, as with
``mp``, every actor sends a heartbeat every second from a thread of its own
(:mod:`kvflow.executor.heartbeat`), here over TCP to a socket the executor binds at its node's
address; the executor reads them while it waits and at each ``check_health``, and fails naming
the rank silent for ``worker_heartbeat_timeout`` seconds (with ``/proc``'s word on its state,
and killed at once, when the actor runs on the executor's node).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any, NoReturn

import zmq

from kvflow.config import EngineConfig
from kvflow.executor.base import Executor, StepFuture
from kvflow.executor.heartbeat import (
    HEARTBEAT_INTERVAL_S,
    HeartbeatMonitor,
    describe_silence,
    drain_beats,
    process_state,
)
from kvflow.executor.ray_cluster import (
    check_cluster_fits,
    import_ray,
    ray_connect_error,
    worker_bundle,
)
from kvflow.executor.ray_worker import RayWorkerWrapper
from kvflow.executor.step_codec import StepCodec
from kvflow.sched_output import GrammarBitmask, SchedulerOutput

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a wait checks the other ranks' calls for failures
# How long a rank's error waits for a peer's death to show (see RayExecutor._fail_rank): a
# killed actor's peers fail in their collective at once, Ray reports the death a moment later.
_DEATH_GRACE_S = 2.0


class RayExecutor(Executor):
    """One Ray actor per rank.

    Raises:
        ValueError: if Ray is not installed or the cluster cannot hold ``world_size`` bundles
            within ``placement_timeout_s``; WorkerConfigError (a ValueError) if a worker
            finds the model does not fit the configuration while it starts.
        ExecutorError: if a worker fails to start, and from later calls if one fails.
    """

    def __init__(self, config: EngineConfig, source: Any, hf_config: Any, dtype: Any,
                 placement_timeout_s: float = 120.0) -> None:
        super().__init__(config, source, hf_config, dtype)
        self.ray = import_ray()
        self.world_size = config.parallel_config.world_size
        self.max_concurrent_batches = config.parallel_config.pipeline_parallel_size
        self.codec = StepCodec()
        self._sent = 0  # steps sent (a worker's ValueError before the first is bad input)
        self._started_ray = False
        self._local_cluster = False  # _init_ray started a cluster on this machine
        self.actors: list[Any] = []
        self._pings: dict[Any, int] = {}  # check_health's pings not yet answered: ref -> rank
        self._pg = None
        self._heartbeat_timeout_s = config.parallel_config.worker_heartbeat_timeout
        self._heartbeats: HeartbeatMonitor | None = None  # set once every actor is ready
        self._beats: zmq.Socket | None = None
        self._whereabouts: list[tuple[str, int]] = []  # per rank: (Ray node id, pid)
        try:
            self._init_ray()
            self._init_heartbeat_socket()
            self._init_placement_group(placement_timeout_s)
            self._init_actors()
        except BaseException:
            self.shutdown()
            raise

    def _init_ray(self) -> None:
        """Join the cluster in ``RAY_ADDRESS`` (else start a local one) unless this process
        is connected to one already.

        Raises:
            ValueError: if the cluster in ``RAY_ADDRESS`` cannot be joined (was: Ray's
                ConnectionError, a traceback and exit 1, after its 20 s of retries).
        """
        if self.ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        try:
            self.ray.init(address=address, log_to_driver=True)
        except ConnectionError as e:
            if not address:
                raise
            raise ValueError(ray_connect_error(address, e)) from None
        self._started_ray = True  # shutdown() disconnects (and stops a local cluster)
        self._local_cluster = address is None

    def _init_heartbeat_socket(self) -> None:
        """Bind the PULL socket the actors' heartbeats arrive at: TCP at this node's address
        (actors may run on other nodes), a port picked free."""
        self._zmq = zmq.Context()
        self._beats = self._zmq.socket(zmq.PULL)
        self._beats.setsockopt(zmq.LINGER, 0)
        ip = self.ray.util.get_node_ip_address()
        port = self._beats.bind_to_random_port(f"tcp://{ip}")
        self._heartbeat_addr = f"tcp://{ip}:{port}"

    def _init_placement_group(self, timeout_s: float) -> None:
        self._bundle = worker_bundle(self.ray, self.config)
        check_cluster_fits(self.ray, self._bundle, self.world_size, local=self._local_cluster,
                           timeout_s=timeout_s)
        from ray.util.placement_group import placement_group

        self._pg = placement_group([dict(self._bundle)] * self.world_size, strategy="PACK")
        ready, _ = self.ray.wait([self._pg.ready()], timeout=timeout_s)
        if not ready:
            raise ValueError(f"the Ray cluster cannot place {self.world_size} workers of "
                             f"{self._bundle} within {timeout_s:.0f} s (cluster resources: "
                             f"{self.ray.cluster_resources()})")

    def _init_actors(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = self.ray.remote(RayWorkerWrapper)
        resources = {"num_gpus": 1} if "GPU" in self._bundle else {"num_cpus": 1}
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)
            self.actors.append(actor_cls.options(scheduling_strategy=strategy,
                                                 **resources).remote())
        ip, port = self.ray.get(self.actors[0].node_address.remote())
        init_method = f"tcp://{ip}:{port}"
        interval = min(HEARTBEAT_INTERVAL_S, self._heartbeat_timeout_s / 4)
        self._wait([a.init_worker.remote(rank, init_method, self.config, self.source,
                                         self.hf_config, self.dtype, self._heartbeat_addr,
                                         interval)
                    for rank, a in enumerate(self.actors)], starting=True)
        self._whereabouts = self._wait([a.whereabouts.remote() for a in self.actors],
                                       starting=True)
        self._await_first_beats()
        logger.info("started %d Ray workers (rendezvous %s)", self.world_size, init_method)

    def _await_first_beats(self) -> None:
        """Wait (up to ``worker_heartbeat_timeout``) until every actor's first heartbeat has
        arrived, then judge them from now on. An actor on another node whose heartbeats
        cannot reach this node's port (a firewall) fails the start-up saying so, rather than
        the running engine ``worker_heartbeat_timeout`` later as a silent rank.

        Raises:
            ExecutorError: naming the ranks not heard from and the address they could not
                reach.
        """
        start = time.monotonic()
        monitor = HeartbeatMonitor(self.world_size, self._heartbeat_timeout_s, start)
        heard: set[int] = set()
        while len(heard) < self.world_size:
            if time.monotonic() - start > self._heartbeat_timeout_s:
                missing = sorted(set(range(self.world_size)) - heard)
                self._fail(f"worker rank(s) {missing} started but sent no heartbeat to "
                           f"{self._heartbeat_addr} within {self._heartbeat_timeout_s:g} s "
                           "(worker_heartbeat_timeout): every Ray node must reach this "
                           "node's address on that port (a firewall?), and the actor run")
            if self._beats.poll(int(_POLL_S * 1000)):
                heard |= drain_beats(self._beats, monitor) & set(range(self.world_size))
        self._heartbeats = monitor

    # ---- calls ---------------------------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._check_failed()
        return self._wait([a.rpc.remote(method, *args) for a in self.actors])

    def execute_model_async(self, sched: SchedulerOutput,
                            grammar_bitmask: GrammarBitmask | None = None) -> StepFuture:
        self._check_failed()
        payload = self.ray.put(self.codec.encode((sched, grammar_bitmask)))  # stored once
        self._sent += 1
        refs = [a.execute_model.remote(payload) for a in self.actors]
        return StepFuture(lambda: self._step_result(refs))

    def _step_result(self, refs: list[Any]) -> Any:
        results = self._wait(refs)
        encoded = next(r for r in results if r is not None)
        return self.codec.decode_result(encoded)

    def _wait(self, refs: list[Any], starting: bool = False) -> list[Any]:
        """Every rank's result of one call, by rank; a failed rank ends the wait at once.

        Raises:
            WorkerConfigError: if the first failed call raised ValueError before the first
                step (the worker's start-up or the engine's set-up calls).
            ExecutorError: naming the first rank whose call failed, otherwise.
        """
        pending = dict(zip(refs, range(len(refs))))
        results: dict[int, Any] = {}
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            self._check_heartbeats()
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = self.ray.get(ref)
                except Exception as e:  # noqa: BLE001 - any actor failure is fatal
                    cause = getattr(e, "cause", None)
                    if self._sent == 0 and isinstance(cause, ValueError):
                        self._fail_config(rank, str(cause))
                    self._fail_rank(rank, e, pending, starting)
        return [results[r] for r in range(len(refs))]

    def _fail_rank(self, rank: int, error: Exception, pending: dict[Any, int],
                   starting: bool) -> NoReturn:
        """Rank ``rank``'s call raised ``error``; ``pending``: the other ranks' calls not yet
        done (ref -> rank). When a peer's actor died (killed, OOM), the others fail inside a
        collective at once (gloo: "Connection reset by peer"), before Ray reports the death:
        name the rank whose actor died as the cause if its call fails so within
        ``_DEATH_GRACE_S``. (Was: the first error seen was named, so a killed rank 1 was
        reported as rank 0's connection error.)

        Raises:
            ExecutorError: always, naming the dead rank, else ``rank``.
        """
        what = "failed to start" if starting else "failed"
        if not isinstance(error, self.ray.exceptions.RayActorError):
            dead = self._dead_peer(pending)
            if dead is not None:
                then = _describe(error)
                then = then if len(then) <= 80 else then[:77] + "..."
                self._fail(f"worker rank {dead[0]} {what}: {_describe(dead[1])} "
                           f"(then rank {rank} failed: {then})")
        self._fail(f"worker rank {rank} {what}: {_describe(error)}")

    def _dead_peer(self, pending: dict[Any, int]) -> tuple[int, Exception] | None:
        """(rank, its error) of the first of ``pending``'s calls (ref -> rank) to fail
        because its actor died, waited for up to ``_DEATH_GRACE_S``; None if none does."""
        pending = dict(pending)
        deadline = time.monotonic() + _DEATH_GRACE_S
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=min(left, _POLL_S))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayActorError as e:
                    return rank, e
                except Exception:  # noqa: BLE001, S110 - another rank's own error: not a death
                    pass
        return None

    # ---- failure and shutdown ------------------------------------------------------------------
    @property
    def health_check_interval_s(self) -> float:
        """A heartbeat period: a quarter of ``worker_heartbeat_timeout``, at most 1 s."""
        return min(HEARTBEAT_INTERVAL_S, self._heartbeat_timeout_s / 4)

    def _check_heartbeats(self) -> None:
        """Record every heartbeat received, then fail on the first rank silent for longer
        than ``worker_heartbeat_timeout`` (once every actor started). A silent actor on
        this node is SIGKILLed first, as a frozen engine core is (not left to ``ray.kill``,
        whose effect on a stopped process was not checked).

        Raises:
            ExecutorError: naming the silent rank, its pid and (on this node) its state.
        """
        if self._heartbeats is None:
            return
        drain_beats(self._beats, self._heartbeats)
        silent = self._heartbeats.silent_ranks(time.monotonic())
        if not silent:
            return
        rank, age = silent[0]
        node, pid = self._whereabouts[rank]
        state = None
        if node == self.ray.get_runtime_context().get_node_id():
            state = process_state(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._fail(describe_silence(rank, pid, age, self._heartbeat_timeout_s, state))

    def check_health(self) -> None:
        """Raise if a worker has failed, without waiting: collect the answers to the pings the
        previous call sent (a killed actor's raises ActorDiedError), then ping every rank
        not still being pinged. An idle engine calls it every second, so a killed actor is
        found within about two. (Was: nothing was checked, so an idle engine's killed actor
        went unnoticed until the next request's step failed on it.)

        Raises:
            ExecutorError: naming the rank whose ping failed, or that sent no heartbeat for
                ``worker_heartbeat_timeout`` seconds, or if a worker failed before.
        """
        self._check_failed()
        self._check_heartbeats()
        if self._pings:
            ready, _ = self.ray.wait(list(self._pings), num_returns=len(self._pings), timeout=0)
            for ref in ready:
                rank = self._pings.pop(ref)
                try:
                    self.ray.get(ref)
                except Exception as e:  # noqa: BLE001 - any failed ping is a failed worker
                    self._fail(f"worker rank {rank} failed: {_describe(e)}")
        pinged = set(self._pings.values())
        for rank, actor in enumerate(self.actors):
            if rank not in pinged:
                self._pings[actor.getpid.remote()] = rank

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, and stop Ray if this executor started
        it (idempotent)."""
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead
                self.ray.kill(actor)
        self.actors = []
        self._pings = {}
        self._heartbeats = None
        if self._beats is not None:
            self._beats.close(linger=0)
            self._zmq.term()
            self._beats = None
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray and self.ray.is_initialized():
            self.ray.shutdown()
            self._started_ray = False


def _describe(error: Exception) -> str:
    """The root cause of a Ray task error in one line."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0] if first else ''}"
