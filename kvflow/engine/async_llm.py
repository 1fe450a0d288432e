"""AsyncLLM: the serving engine. EngineCore runs in its own process (one per data-parallel
replica); this side does the rest.

```
API process (asyncio)                                 engine-core process (busy loop)
  add_request: InputProcessor -> Requests  --AddRequests-->  EngineCore.add_request
  abort:       OutputProcessor.abort       --AbortRequests-> EngineCore.abort_requests (frees KV)
  output loop: OutputProcessor.process     <--EngineOutputs--  EngineCore.step + stats
               (detokenize, stop strings)                     (every step with new tokens)
               -> per-request RequestStream (delta RequestOutputs)
```
Both channels are ZMQ PUSH/PULL pairs over ``ipc://`` sockets in a private temporary
directory, carrying msgspec/msgpack messages (``kvflow.engine.messages``); with
``--data-parallel-size N`` there is one input socket per replica and one shared output socket.
The HTTP event loop only ever does non-blocking sends and awaits receives, so it never waits on
the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from kvflow.config import EngineConfig
from kvflow.engine.core_client import (
    CoreProcess,
    ReplicaState,
    replica_config,
    replica_name,
    wait_ready,
)
from kvflow.engine.dp_balancer import DPLoadBalancer
from kvflow.engine.messages import (
    AbortRequests,
    AddLoRA,
    AddRequests,
    AdmissionVerdicts,
    EngineCoreRequest,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    RemoveLoRA,
    Shutdown,
    UtilityResult,
    output_decoder,
)
from kvflow.engine.streams import AdmissionRejected, EngineDeadError, RequestStream, collect
from kvflow.engine_outputs import EngineStats
from kvflow.input_processor import InputProcessor
from kvflow.lora.request import LoRARequest
from kvflow.metrics import RequestStatsTracker, ServerMetrics
from kvflow.models.generation_config import load_eos_token_ids, load_sampling_defaults
from kvflow.models.loader import load_hf_config, load_tokenizer, resolve_eos_token_id
from kvflow.models.model_resolver import ModelSource, resolve_model
from kvflow.models.registry import is_multimodal
from kvflow.multimodal import make_mm_processor
from kvflow.multimodal_inputs import MultiModalFeature
from kvflow.output_processor import OutputProcessor
from kvflow.pooling_params import PoolingParams
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_POLL_MS = 1000  # how often the output loop checks that the core processes are alive

__all__ = ["AdmissionRejected", "AsyncLLM", "EngineDeadError", "RequestStream", "collect"]


class AsyncLLM:
    """Engine client for the server: starts the engine-core process(es) and streams outputs.

    With ``data_parallel_size = N`` it runs N engine-core processes (replicas, each a whole
    engine with its own workers and KV cache) and sends each request to one of them
    (:class:`~kvflow.engine.dp_balancer.DPLoadBalancer`: prefix-cache affinity bounded by
    queue depth). A replica that dies fails only its own requests; ``on_dead`` decides what
    follows (the server exits, or :meth:`restart` replaces the dead replicas while the others
    keep serving).

    Construction blocks until the model is loaded (call it before the event loop serves);
    then ``await start()`` inside the loop, ``add_request`` / ``abort`` per request, and
    ``await shutdown()`` at the end.

    Args:
        config: engine configuration (each core process builds its EngineCore from it).
        metrics: where to record request and engine metrics (default: a fresh ServerMetrics).
        start_timeout: seconds to wait for the core processes to load the model.

    Raises:
        RuntimeError: if a core process fails to start or exceeds ``start_timeout``.
        ValueError: for a bad model or tokenizer.
    """

    def __init__(self, config: EngineConfig, metrics: ServerMetrics | None = None,
                 start_timeout: float = 600.0) -> None:
        self.config = config
        self.metrics = metrics or ServerMetrics(config.model_config.model)
        self.tracker = RequestStatsTracker(self.metrics)
        self.num_replicas = config.parallel_config.data_parallel_size
        self.stats = [EngineStats() for _ in range(self.num_replicas)]
        self._streams: dict[str, RequestStream] = {}
        self._waiting: set[str] = set()  # accepted, no output yet
        self._dead: BaseException | None = None  # set when no replica is left
        self._output_task: asyncio.Task | None = None
        self._ready_events: dict[int, asyncio.Future] = {}  # replicas restarting
        # AddLoRA / RemoveLoRA calls awaiting answers: call id -> (replica, future)
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        # Called (in the event loop) when a core process dies or fails; see start().
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._init_ipc()
        try:
            mc = config.model_config
            source = resolve_model(mc.model, mc.download_dir)  # a Hub download happens here
            self.sampling_defaults = load_sampling_defaults(source, mc.generation_config)
            self._eos_token_ids = load_eos_token_ids(source)
            self._start_core_processes()  # their resolve_model then finds the snapshot cached
            self._init_tokenizer(source)  # while the core processes load the model
            self._init_mm_processor(source)
            self._init_processors(self._wait_ready(start_timeout))
        except BaseException:
            self.close()
            raise

    # ---- start-up ----------------------------------------------------------------------------
    def _init_ipc(self) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="kvflow-")
        self._ctx = zmq.Context()
        self._output_addr = f"ipc://{os.path.join(self._ipc_dir, 'output')}"
        self._output = self._ctx.socket(zmq.PULL)  # every replica's core pushes here
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self._output_addr)
        self._async_output: zmq.asyncio.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = output_decoder()
        self.cores: list[CoreProcess] = []

    def _start_core_processes(self) -> None:
        for index in range(self.num_replicas):
            self.cores.append(CoreProcess(self._ctx, self._ipc_dir,
                                          replica_config(self.config, index),
                                          self._output_addr))
            self.cores[index].start(logging.getLogger("kvflow").getEffectiveLevel())

    def _init_tokenizer(self, source: ModelSource) -> None:
        mc = self.config.model_config
        self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(source, mc.tokenizer)

    def _name(self, index: int) -> str:
        return replica_name(index, self.num_replicas)

    def _init_mm_processor(self, source: ModelSource) -> None:
        """Images are decoded, checked and preprocessed here, in the API process (a bad
        image is a 400 before anything is queued); None for a text-only model."""
        self._mm_processor = None
        if source.kind == "gguf":  # kvflow loads no vision-language GGUF
            return
        try:
            hf_config = load_hf_config(source)
            if not is_multimodal(hf_config):
                return
        except ValueError:  # an unreadable config or unknown architecture: the core reports it
            return
        self._mm_processor = make_mm_processor(source, hf_config, self.tokenizer,
                                               self.config.multimodal_config)

    def _wait_ready(self, timeout: float) -> EngineReady:
        """Block until every replica reported ``EngineReady`` (before the event loop runs);
        returns replica 0's."""
        return wait_ready(self._output, self._decoder, self.cores, timeout, self._on_ready)[0]

    def _on_ready(self, ready: EngineReady) -> None:
        core = self.cores[ready.engine_index]
        core.state = ReplicaState.LIVE
        self.stats[core.index] = ready.stats
        self.metrics.reset_engine(core.index)
        self.metrics.record_engine_stats(ready.stats, core.index)
        future = self._ready_events.pop(core.index, None)
        if future is not None and not future.done():
            future.set_result(ready)

    def _init_processors(self, ready: EngineReady) -> None:
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = ready.num_blocks  # per replica
        self.task = ready.task
        self.processor = InputProcessor(self.tokenizer, ready.max_model_len, ready.vocab_size,
                                        resolve_eos_token_id(self.tokenizer, ready),
                                        self._mm_processor,
                                        eos_token_ids=self._eos_token_ids,
                                        pooler=ready.pooler, hidden_size=ready.hidden_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.balancer = DPLoadBalancer(self.num_replicas, ready.block_size)

    async def start(self) -> None:
        """Start the output loop on the running event loop. When a core process dies or
        fails, its open streams get an ``EngineDeadError`` and ``on_dead(error)`` (if set) is
        called; once no replica is left, new requests are refused."""
        self._async_output = zmq.asyncio.Socket.from_socket(self._output)
        self._output_task = asyncio.create_task(self._output_loop(), name="kvflow-outputs")

    @property
    def core_pid(self) -> int | None:
        """The (first) engine-core process id (None before it started)."""
        return self.cores[0].pid if self.cores else None

    async def restart(self, timeout: float = 600.0) -> None:
        """Replace every dead replica by a new core process (same config; the model loads
        again) and serve with it once ready; the live replicas keep serving meanwhile (with
        one replica, requests are refused with ``EngineDeadError`` until it is ready).
        Replicas that die while this runs are replaced too.

        Raises:
            RuntimeError: if a new core fails to start (that replica stays dead).
        """
        while dead := [c for c in self.cores if c.state is ReplicaState.DEAD]:
            for old in dead:
                self._respawn(old)
            for old in dead:
                await self._wait_restarted(old.index, timeout)
        self._dead = None

    def _respawn(self, old: CoreProcess) -> None:
        old.stop(self._encoder.encode(Shutdown()))
        core = CoreProcess(self._ctx, self._ipc_dir, old.config, self._output_addr,
                           old.generation + 1)
        self._ready_events[old.index] = asyncio.get_running_loop().create_future()
        self.cores[old.index] = core
        core.start(logging.getLogger("kvflow").getEffectiveLevel())

    async def _wait_restarted(self, index: int, timeout: float) -> None:
        """Wait for replica ``index``'s ``EngineReady``.

        Raises:
            RuntimeError: if it died instead or did not report within ``timeout`` seconds.
        """
        future = self._ready_events.get(index)
        try:
            if future is not None:
                await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            self._ready_events.pop(index, None)
            raise RuntimeError(f"{self._name(index)} did not restart within {timeout:.0f} s") \
                from None
        if self.cores[index].state is not ReplicaState.LIVE:
            raise RuntimeError(f"{self._name(index)} failed to restart: "
                               f"{self.cores[index].death}")

    # ---- requests ----------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        """Whether a replica takes requests."""
        return self._dead is None and any(c.is_live for c in self.cores)

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine stopped (e.g. which worker rank died), or None while it runs."""
        if self._dead is not None:
            return self._dead
        return None if self.is_healthy else next(
            (c.death for c in self.cores if c.death is not None), None)

    @property
    def num_waiting_requests(self) -> int:
        """Accepted requests that have not produced any token yet (queued or in prefill)."""
        return len(self._waiting)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0,
                    mm_features: list[MultiModalFeature] | None = None,
                    client_id: str = "",
                    lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and queue one prompt (its ``n`` samples) on one replica; returns its
        output stream. Fields ``params`` was not given take the model's sampling defaults
        (``sampling_defaults``, from its generation_config.json). ``mm_features``: the
        prompt's preprocessed images (``processor.attach_images``; placeholders already
        expanded in ``prompt_token_ids``). ``client_id`` names the sender for the fair
        policy. With admission control, await ``admitted(stream)``.
        ``lora_request``: the adapter it runs with (added with ``add_lora`` first).

        Raises:
            ValueError: for a bad prompt or parameters, or a request id in use (nothing queued).
            EngineDeadError: if no replica is running.
        """
        if not self.is_healthy:
            raise EngineDeadError("the engine core is not running")
        arrival = time.monotonic()
        params = params.with_defaults(self.sampling_defaults)
        requests = self.processor.make_requests(request_id, prompt_token_ids, params, arrival,
                                                priority, mm_features, client_id,
                                                lora_request)
        return self._queue(request_id, prompt, requests, arrival)

    def _queue(self, request_id: str, prompt: str | None, requests: list[Request],
               arrival: float) -> RequestStream:
        """Send one user request's samples to one replica; returns its stream.

        Raises:
            ValueError: if the request cannot be encoded (nothing registered then).
        """
        try:  # encode before registering anything, so a refusal leaves no state behind
            payload = self._encoder.encode(
                AddRequests([EngineCoreRequest.from_request(r) for r in requests]))
        except (msgspec.EncodeError, OverflowError, TypeError) as e:
            raise ValueError(f"request {request_id!r} cannot be encoded: {e}") from None
        self.output_processor.add_request(prompt, requests, delta=True)
        prompt_token_ids = requests[0].prompt_token_ids
        replica = self.balancer.choose(prompt_token_ids, [c.is_live for c in self.cores],
                                       [s.kv_cache_usage for s in self.stats])
        self.balancer.assign(request_id, replica, len(requests))
        logger.debug("request %s -> replica %d (depths %s)", request_id, replica,
                     self.balancer.depth)
        stream = RequestStream(request_id, self.config.scheduler_config.admission_control)
        self._streams[request_id] = stream
        self._waiting.add(request_id)
        self.tracker.start(request_id, arrival, len(prompt_token_ids), len(requests))
        self.cores[replica].send(payload)
        return stream

    @staticmethod
    async def admitted(stream: RequestStream) -> None:
        """Wait until the engine core queued the stream's request (immediate without
        admission control).

        Raises:
            AdmissionRejected: if admission control refused it (nothing is left queued).
            EngineDeadError: if the engine died first.
        """
        if stream.admitted is not None:
            await stream.admitted

    def add_pooling_request(self, request_id: str, prompt: str | None,
                            prompt_token_ids: list[int], params: PoolingParams | None = None
                            ) -> RequestStream:
        """Validate and queue one embedding request; its stream ends with one
        ``EmbeddingRequestOutput``.

        Raises:
            ValueError: on a generation model, for a bad prompt or ``dimensions``.
            EngineDeadError: if no replica is running.
        """
        if not self.is_healthy:
            raise EngineDeadError("the engine core is not running")
        arrival = time.monotonic()
        request = self.processor.make_pooling_request(request_id, prompt_token_ids, params,
                                                      arrival)
        return self._queue(request_id, prompt, [request], arrival)

    def abort(self, request_id: str) -> None:
        """Stop a request now (no-op if it already finished); its core frees its KV blocks
        before its next step."""
        sample_ids = self.output_processor.abort(request_id)
        self._streams.pop(request_id, None)
        self._waiting.discard(request_id)
        replica = self.balancer.replica_of(request_id)
        self.balancer.finish(request_id)
        if sample_ids:
            self.tracker.abort(request_id)
            if replica is not None:
                self._send(replica, AbortRequests(sample_ids))

    # ---- LoRA adapters -----------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter in the engine core (read and checked against the model there).

        Raises:
            ValueError: when the engine refuses it (the message says why).
            EngineDeadError: if the engine is gone.
        """
        await self._call(AddLoRA(0, lora_request))  # each replica's call gets its own id

    async def remove_lora(self, lora_int_id: int) -> None:
        """Forget a LoRA adapter in the engine core (running requests finish with it).

        Raises:
            EngineDeadError: if the engine is gone.
        """
        await self._call(RemoveLoRA(0, lora_int_id))

    async def _call(self, msg: AddLoRA | RemoveLoRA) -> None:
        """Send the call to every live replica (each with its own ``call_id``) and wait for
        all answers; the first refusal is raised as a ValueError."""
        if not self.is_healthy:
            raise EngineDeadError("the engine core is not running")
        futures = []
        for core in self.cores:
            if core.is_live:
                call_id = next(self._call_ids)
                future = asyncio.get_running_loop().create_future()
                self._calls[call_id] = (core.index, future)
                self._send(core.index, msgspec.structs.replace(msg, call_id=call_id))
                futures.append(future)
        errors = await asyncio.gather(*futures)
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise ValueError(error)

    def _answer_call(self, msg: UtilityResult) -> None:
        _, future = self._calls.pop(msg.call_id, (None, None))
        if future is not None and not future.done():
            future.set_result(msg.error)

    def _fail_calls(self, error: EngineDeadError, replica: int | None = None) -> None:
        """End the calls waiting on ``replica`` (every replica: None) with ``error``."""
        for call_id, (index, future) in list(self._calls.items()):
            if replica is None or index == replica:
                del self._calls[call_id]
                if not future.done():
                    future.set_exception(error)

    def _send(self, replica: int,
              msg: AddRequests | AbortRequests | Shutdown | AddLoRA | RemoveLoRA) -> None:
        core = self.cores[replica]
        if core.state is not ReplicaState.DEAD and not core.input.closed:
            core.send(self._encoder.encode(msg))

    # ---- outputs -----------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        next_check = 0.0
        while True:
            try:
                if time.monotonic() >= next_check:  # even while other replicas keep talking
                    self._check_processes()
                    next_check = time.monotonic() + _POLL_MS / 1000
                if not await self._async_output.poll(_POLL_MS):
                    continue
                msg = self._decoder.decode(await self._async_output.recv())
                if isinstance(msg, EngineFailed):
                    self._replica_died(msg.engine_index, EngineDeadError(
                        f"{self._name(msg.engine_index)} failed: {msg.message}"))
                elif isinstance(msg, EngineReady):
                    self._on_ready(msg)
                elif isinstance(msg, EngineOutputs):
                    self._handle_outputs(msg)
                elif isinstance(msg, AdmissionVerdicts):
                    self._handle_verdicts(msg)
                elif isinstance(msg, UtilityResult):
                    self._answer_call(msg)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the loop itself broke: end every request
                logger.exception("output loop failed")
                self.fail_all(EngineDeadError(f"output loop failed: {e}"))
                if self.on_dead is not None:
                    self.on_dead(self._dead)
                return

    def _check_processes(self) -> None:
        for core in self.cores:
            if core.state is not ReplicaState.DEAD and not core.is_alive:
                self._replica_died(core.index, EngineDeadError(
                    f"{self._name(core.index)} process exited with code "
                    f"{core.proc.exitcode}"))

    def _replica_died(self, index: int, error: EngineDeadError) -> None:
        """Fail the replica's open requests, stop routing to it, tell ``on_dead``."""
        core = self.cores[index]
        if core.state is ReplicaState.DEAD:
            return
        was_live = core.state is ReplicaState.LIVE  # else a restart failed: restart() says so
        core.state, core.death = ReplicaState.DEAD, error
        failed = self.balancer.requests_on(index)
        self.balancer.forget_replica(index)
        self.metrics.reset_engine(index)
        logger.error("%s lost (%s): ending its %d open requests with an error%s",
                     self._name(index), error, len(failed),
                     "" if self.is_healthy else "; new requests get 503")
        for request_id in failed:
            self._fail_request(request_id, error)
        self._fail_calls(error, index)
        future = self._ready_events.pop(index, None)
        if future is not None and not future.done():
            future.set_result(None)  # a restart that failed
        if not any(c.state is not ReplicaState.DEAD for c in self.cores):
            self._dead = error
        if was_live and self.on_dead is not None:
            self.on_dead(error)

    def _handle_outputs(self, msg: EngineOutputs) -> None:
        self.stats[msg.engine_index] = msg.stats
        self.metrics.record_engine_stats(msg.stats, msg.engine_index)
        outputs, stopped = self.output_processor.process(msg.outputs)
        if stopped:  # stop strings matched: free their KV blocks now
            self._send(msg.engine_index, AbortRequests(stopped))
        now = time.monotonic()
        for out in outputs:
            self.tracker.observe(out, now)
            self._waiting.discard(out.request_id)
            if out.finished:
                self.balancer.finish(out.request_id)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]

    def _handle_verdicts(self, msg: AdmissionVerdicts) -> None:
        """Admission control's answers: resolve the accepted streams; drop the refused
        requests (their core queued none of their samples) and fail their streams."""
        for request_id in msg.accepted:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.settle()
        for rejection in msg.rejected:
            stream = self._streams.pop(rejection.request_id, None)
            self.output_processor.abort(rejection.request_id)
            self._waiting.discard(rejection.request_id)
            self.balancer.finish(rejection.request_id)
            self.tracker.forget(rejection.request_id)
            self.metrics.rejected.inc()
            if stream is not None:
                stream.settle(AdmissionRejected(rejection.message, rejection.retry_after_s))

    def _fail_request(self, request_id: str, error: EngineDeadError) -> None:
        self.output_processor.abort(request_id)
        self.tracker.abort(request_id)
        self._waiting.discard(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.settle(error)
            stream.put(error)

    def fail_all(self, error: EngineDeadError) -> None:
        """End every open request with ``error`` and refuse new ones (the server is
        stopping)."""
        self._dead = error
        for request_id in list(self._streams):
            self.balancer.finish(request_id)
            self._fail_request(request_id, error)
        self._waiting.clear()
        self._fail_calls(error)

    # ---- shutdown ----------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop the output loop and the core processes; release the sockets."""
        if self._output_task is not None:
            self._output_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._output_task
            self._output_task = None
        self.close()

    def close(self) -> None:
        """Synchronous teardown (idempotent): ask the cores to stop, then make sure they do;
        release the sockets and the IPC directory."""
        shutdown = self._encoder.encode(Shutdown())
        for core in self.cores:  # all stop at once, then each is waited for
            core.ask_to_stop(shutdown)
        for core in self.cores:
            core.stop(shutdown)
        for sock in (self._async_output, self._output):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
