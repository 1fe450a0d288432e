"""Data-parallel engine cores for the offline ``LLM``: N core processes behind one blocking
client that ``LLMEngine`` drives the way it drives an in-process ``EngineCore``.

``LLM(model, data_parallel_size=N)`` starts N engine-core processes (the same
``run_engine_core`` that ``kvflow serve`` runs, each a whole engine with its own workers and KV
cache), sends each prompt to one of them (:class:`~kvflow.engine.dp_balancer.DPLoadBalancer`:
prefix-cache affinity bounded by queue depth, KV use breaking ties) and gathers their
outputs. Every core steps on its own, so the replicas decode at the same time; ``step()``
returns whatever outputs arrived, from any replica. A replica whose process exits, or that
sends no heartbeat for ``engine_heartbeat_timeout`` seconds (stopped or frozen: it is killed;
``kvflow/engine/core_heartbeat.py``), makes ``step`` raise naming it; the others serve on.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
import weakref
from collections.abc import Callable

from kvflow.config import EngineConfig
from kvflow.engine.core_client import CoreProcess, ReplicaState
from kvflow.engine.core_heartbeat import CoreLiveness
from kvflow.engine.dp_balancer import DPLoadBalancer
from kvflow.engine.messages import (
    AbortRequests,
    AddLoRA,
    AddRequests,
    EngineCoreRequest,
    EngineFailed,
    EngineHeartbeat,
    EngineOutputs,
    EngineReady,
    RemoveLoRA,
    ResetPrefixCache,
    UtilityCall,
    UtilityResult,
)
from kvflow.engine.replica_set import ReplicaSet
from kvflow.engine_outputs import EngineCoreOutput, EngineStats
from kvflow.lora.request import LoRARequest, already_loaded
from kvflow.request import Request

logger = logging.getLogger(__name__)

_POLL_MS = 1000  # how often step() checks that the core processes are alive while waiting
# (more often with an engine_heartbeat_timeout under 4 s: CoreLiveness.check_interval_s)


class DPCoreClient:
    """N engine-core processes with one balancer; the blocking counterpart of ``AsyncLLM``'s
    replica handling, without an event loop.

    Args:
        config: the engine config (``parallel_config.data_parallel_size`` replicas).
        start_timeout: seconds to wait for every replica to load the model.

    Attributes:
        ready: replica 0's ``EngineReady`` (max_model_len, vocab_size, eos_token_id, ...).
        stats: each replica's latest ``EngineStats``.

    Raises:
        RuntimeError: from the constructor if a replica fails to start (naming it); from
            ``step`` if a replica dies, fails or stops sending heartbeats while requests are
            open.
    """

    def __init__(self, config: EngineConfig, start_timeout: float = 600.0) -> None:
        self.num_replicas = config.parallel_config.data_parallel_size
        self.replicas = ReplicaSet(config, prefix="kvflow-dp-")
        # An LLM dropped without shutdown() (garbage collected) stops its replicas too, as
        # the multiprocess executor stops its workers: the finalizer holds the ReplicaSet,
        # not this client. (Was: the core processes ran on until the interpreter exited.)
        self._finalizer = weakref.finalize(self, self.replicas.close)
        try:
            self.replicas.start()
            ready = self.replicas.wait_ready(start_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.ready: EngineReady = ready[0]
        self.max_model_len = self.ready.max_model_len
        self.stats: list[EngineStats] = [ready[i].stats for i in range(self.num_replicas)]
        self.balancer = DPLoadBalancer(self.num_replicas, self.ready.block_size)
        self._pending: collections.deque[EngineCoreOutput] = collections.deque()
        self._next_check = 0.0
        self.liveness = CoreLiveness(self.num_replicas,
                                     config.parallel_config.engine_heartbeat_timeout,
                                     time.monotonic())
        self._check_s = min(_POLL_MS / 1000, self.liveness.check_interval_s)
        self._poll_ms = max(1, round(self._check_s * 1000))
        self._call_ids = itertools.count()
        self.enable_lora = config.lora_config.enable_lora
        self.loras: dict[int, LoRARequest] = {}  # loaded on every replica, by lora_int_id

    @property
    def cores(self) -> list[CoreProcess]:
        """The replicas' core processes, by index."""
        return self.replicas.cores

    def add_requests(self, requests: list[Request]) -> int:
        """Send the samples of one prompt to one replica (chosen by the balancer); returns
        the replica's index.

        Raises:
            RuntimeError: if no replica is running.
        """
        replica = self.balancer.choose_for(requests[0], [c.is_live for c in self.cores],
                                           [s.kv_cache_usage for s in self.stats])
        for r in requests:  # depth counts samples; each finishes on its own
            self.balancer.assign(r.request_id, replica, 1)
        self.cores[replica].send(self.replicas.encoder.encode(
            AddRequests([EngineCoreRequest.from_request(r) for r in requests])))
        return replica

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """Stop these samples on their replicas (unknown or finished ids are ignored);
        ``stopped``: stop strings ended them (``EngineCore.abort_requests``)."""
        by_replica: dict[int, list[str]] = collections.defaultdict(list)
        for rid in request_ids:
            replica = self.balancer.replica_of(rid)
            if replica is not None:
                by_replica[replica].append(rid)
                self.balancer.finish(rid)
        for replica, ids in by_replica.items():
            if self.cores[replica].is_live:
                self.cores[replica].send(self.replicas.encoder.encode(AbortRequests(ids, stopped)))

    def holds(self, request_id: str) -> bool:
        """Whether request ``request_id`` (a sample's id) is still this client's: unfinished
        on a live replica, or its last output waits for ``step``. False for one a replica
        that died took with it (``forget_replica``)."""
        return self.balancer.replica_of(request_id) is not None or \
            any(out.request_id == request_id for out in self._pending)

    def has_unfinished_requests(self) -> bool:
        """Whether any sample sent to a replica has not finished."""
        return any(self.balancer.depth) or bool(self._pending)

    def step(self) -> list[EngineCoreOutput]:
        """Wait for the next outputs of any replica and return every one that has arrived
        ([] when nothing is unfinished).

        Raises:
            RuntimeError: naming the replica, if one failed or its process exited.
        """
        while True:
            if time.monotonic() >= self._next_check:  # even while other replicas talk
                self.check_health()
                self._next_check = time.monotonic() + self._check_s
            if self._pending or not any(self.balancer.depth):
                break
            output = self.replicas.output
            # only until the next check is due (see output_loop: late checks forgive silence)
            wait_ms = round((self._next_check - time.monotonic()) * 1000)
            if output.poll(max(1, min(self._poll_ms, wait_ms))):
                while output.poll(0):
                    self._handle(self.replicas.decoder.decode(output.recv()))
        outputs = list(self._pending)
        self._pending.clear()
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes of every live replica (``EngineCore.reset_prefix_cache``),
        waiting for their answers (outputs arriving meanwhile are kept for ``step``).

        Returns:
            True if every replica reset its cache, False if any refused (it had unfinished
            requests).

        Raises:
            RuntimeError: naming the replica, if one failed or its process exited.
        """
        return all(bool(r.result) for r in self._call_all(ResetPrefixCache))

    # ---- LoRA adapters: on every replica -----------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter on every live replica (each checks it as
        ``EngineCore.add_lora`` does) unless it is loaded; a refusal by any replica unloads it
        from the others, so the replicas hold the same adapters.

        Raises:
            ValueError: without enable_lora, for an id in use by another adapter, or the
                replicas' refusal (the adapter cannot be applied to the model).
            RuntimeError: naming the replica, if one failed or its process exited.
        """
        if already_loaded(self.loras, lora_request, self.enable_lora):
            return
        results = self._call_all(lambda call_id: AddLoRA(call_id, lora_request))
        refused = next((r.error for r in results if r.error is not None), None)
        if refused is not None:
            self._call_all(lambda call_id: RemoveLoRA(call_id, lora_request.lora_int_id))
            raise ValueError(refused)
        self.loras[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter on every live replica (requests running with it finish with
        it); False if it was not loaded.

        Raises:
            RuntimeError: naming the replica, if one failed or its process exited.
        """
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self._call_all(lambda call_id: RemoveLoRA(call_id, lora_int_id))
        return True

    def _call_all(self, make: Callable[[int], UtilityCall]) -> list[UtilityResult]:
        """Send ``make(call_id)`` to every live replica and wait for their answers (by
        replica index); outputs arriving meanwhile are kept for ``step``.

        Raises:
            RuntimeError: naming the replica, if one failed or its process exited.
        """
        waiting = {}
        for core in self.cores:
            if core.is_live:
                call_id = next(self._call_ids)
                waiting[call_id] = core.index
                core.send(self.replicas.encoder.encode(make(call_id)))
        results: dict[int, UtilityResult] = {}
        while waiting:
            self.check_health()
            output = self.replicas.output
            if not output.poll(self._poll_ms):
                continue
            msg = self.replicas.decoder.decode(output.recv())
            if isinstance(msg, UtilityResult):
                index = waiting.pop(msg.call_id, None)  # None: an earlier call's answer
                if index is not None:
                    results[index] = msg
            else:
                self._handle(msg)
        return [results[i] for i in sorted(results)]

    def _handle(self, msg: EngineOutputs | EngineFailed | EngineReady | EngineHeartbeat) -> None:
        if isinstance(msg, EngineHeartbeat):
            self.liveness.beat(msg)
        if isinstance(msg, EngineFailed):
            self._fail(msg)
        if isinstance(msg, EngineOutputs):
            self.stats[msg.engine_index] = msg.stats
            for out in msg.outputs:
                if out.finish_reason is not None:
                    self.balancer.finish(out.request_id)
                self._pending.append(out)

    def _fail(self, msg: EngineFailed) -> None:
        """A replica reported a fatal error (its process exits).

        Raises:
            RuntimeError: naming the replica and the error.
        """
        self.cores[msg.engine_index].state = ReplicaState.DEAD
        self.balancer.forget_replica(msg.engine_index)  # its requests and KV cache are gone
        raise RuntimeError(f"{self.replicas.name(msg.engine_index)} failed: "
                           f"{msg.message}")

    def check_health(self) -> None:
        """Raise if a replica's process has exited, or if one sent no heartbeat for
        ``engine_heartbeat_timeout`` seconds (it is killed).

        Raises:
            RuntimeError: naming the replica and its exit code, or its silence.
        """
        for core in self.cores:
            if core.state is ReplicaState.LIVE and not core.is_alive:
                self._lose(core)
                raise RuntimeError(f"{self.replicas.name(core.index)} process "
                                   f"exited with code {core.proc.exitcode}")
        for core, silent_s in self.liveness.silent(self.cores, time.monotonic()):
            why = self.liveness.declare_dead(core, silent_s, self.replicas.name(core.index))
            self._lose(core)
            raise RuntimeError(f"{why}; killed it")

    def _lose(self, core: CoreProcess) -> None:
        """Stop routing to ``core`` (dead): its requests and KV cache are gone."""
        core.state = ReplicaState.DEAD
        self.balancer.forget_replica(core.index)

    def shutdown(self) -> None:
        """Stop every core process and release the sockets (idempotent; also run when this
        client is garbage collected or the interpreter exits)."""
        self._finalizer()
