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

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from kvflow.config import EngineConfig
from kvflow.core.sleep_mode import EngineSleep
from kvflow.engine.async_llm_calls import AsyncLLMCalls
from kvflow.engine.async_llm_generate import AsyncLLMGenerate
from kvflow.engine.async_llm_pooling import AsyncLLMPooling
from kvflow.engine.async_llm_shutdown import AsyncLLMShutdown
from kvflow.engine.completed import COMPLETED, Completed
from kvflow.engine.core_client import CoreProcess, ReplicaState
from kvflow.engine.dp_balancer import DPLoadBalancer
from kvflow.engine.front_end import load_front_end, make_input_processor
from kvflow.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreRequest,
    EngineReady,
)
from kvflow.engine.open_requests import OpenRequests
from kvflow.engine.output_loop import OutputLoop
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.replica_restarts import ReplicaRestarts
from kvflow.engine.replica_set import ReplicaSet
from kvflow.engine.request_args import check_request_args
from kvflow.engine.streams import (
    AdmissionRejected,
    EngineDeadError,
    EngineShutdownError,
    EngineSleepingError,
    RequestFailed,
    RequestRefused,
    RequestStream,
    collect,
)
from kvflow.engine.utility_calls import UtilityCalls
from kvflow.engine_outputs import EngineStats
from kvflow.inputs.embeds import PromptEmbeds
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.inputs.reasoning import OfflineReasoning, ReasoningOptions
from kvflow.lora.request import LoRARequest
from kvflow.metrics.request_stats import RequestStatsTracker
from kvflow.metrics.server import ServerMetrics
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AdmissionRejected", "AsyncLLM", "EngineDeadError", "EngineShutdownError",
           "EngineSleepingError", "RequestFailed", "RequestRefused", "RequestStream",
           "collect"]


class AsyncLLM(AsyncLLMGenerate, AsyncLLMPooling, AsyncLLMCalls, AsyncLLMShutdown):
    """Engine client for the server: starts the engine-core process(es) and streams outputs.

    With ``data_parallel_size = N`` it runs N engine-core processes (replicas, each a whole
    engine with its own workers and KV cache) and sends each request to one of them
    (:class:`~kvflow.engine.dp_balancer.DPLoadBalancer`: prefix-cache affinity bounded by
    queue depth). A replica that dies fails only its own requests; ``on_dead`` decides what
    follows (the server exits, or :meth:`restart` replaces the dead replicas while the others
    keep serving).

    Construction blocks until the model is loaded (call it before the event loop serves);
    then ``await start()`` inside the loop, ``generate`` (vLLM's call: a prompt in, its
    outputs out, cumulative by default) or ``add_request`` / ``abort`` (the server's: token
    ids in, a stream of deltas by default) per request, and ``await shutdown()`` at the end.

    Args:
        config: engine configuration (each core process builds its EngineCore from it).
        metrics: where to record request and engine metrics (default: a fresh ServerMetrics).
        start_timeout: seconds to wait for the core processes to load the model.
        on_tokenizer: called with the tokenizer (None under ``skip_tokenizer_init``) as soon
            as it is loaded, while the core processes still load the model: the server's
            start-up checks of it (a model chat template that does not compile is reported
            then, not minutes later); what it raises ends the start-up.
        start_method: how the core processes start, as ``ReplicaSet``'s argument (None:
            the rule of ``kvflow/engine/start_method.py``).
        reasoning_parser, reasoning_config, structured_outputs_config: the offline
            ``LLM``'s options of these names (vLLM's engine arguments,
            ``kvflow.inputs.reasoning``): the markers every request's
            ``thinking_token_budget`` is counted and ended with and its grammar starts
            after (``{"enable_in_reasoning": True}``: from the first token), checked before
            the model loads and tokenized once; ``generate`` and ``add_request`` give them to
            the requests that need them (a request's own ``reasoning_token_ids`` win). The
            server passes none: it fills its requests' markers from its own flags.

    Raises:
        RuntimeError: if a core process fails to start or exceeds ``start_timeout``.
        ValueError: for a bad model or tokenizer, or a bad ``KVFLOW_WORKER_MULTIPROC_METHOD``,
            or an unknown ``reasoning_parser`` (listing the choices), a bad
            ``reasoning_config`` or ``structured_outputs_config`` (naming it; before any
            process starts), or a reasoning marker that tokenizes to nothing.
    """

    def __init__(self, config: EngineConfig, metrics: ServerMetrics | None = None,
                 start_timeout: float = 600.0,
                 on_tokenizer: Callable[[Any], None] | None = None,
                 start_method: str | None = None, *, reasoning_parser: str | None = None,
                 reasoning_config: dict[str, str] | str | None = None,
                 structured_outputs_config: dict[str, Any] | str | None = None) -> None:
        reasoning = ReasoningOptions.read(reasoning_parser, reasoning_config,
                                          structured_outputs_config)
        self._reasoning = OfflineReasoning()  # until the tokenizer is loaded
        self.config = config
        self.metrics = metrics or ServerMetrics(config.model_config.model)
        self.tracker = RequestStatsTracker(self.metrics)
        self.num_replicas = config.parallel_config.data_parallel_size
        self.stats = [EngineStats() for _ in range(self.num_replicas)]
        self._dead: BaseException | None = None  # set when no replica is left
        self._outputs: OutputLoop | None = None  # started by start()
        self._calls = UtilityCalls()  # AddLoRA / Sleep / ResetPrefixCache / ... awaiting answers
        self._core_ids = itertools.count()  # the suffix of each request's ids in the cores
        # the replicas' sleep state, mirrored once they all answered (new requests checked)
        self.sleep_state = EngineSleep(config.model_config.enable_sleep_mode)
        # Called (in the event loop) when a core process dies or fails; see start().
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self.replicas = ReplicaSet(config, start_method=start_method)
        self._restarts = ReplicaRestarts(self.replicas)
        try:
            self._front = load_front_end(config, self.replicas, on_tokenizer)
            self.tokenizer = self._front.tokenizer
            self.sampling_defaults = self._front.sampling_defaults
            self._reasoning = OfflineReasoning.of(reasoning, self.tokenizer)
            self._init_processors(self._wait_ready(start_timeout))
        except BaseException:
            self.close()
            raise

    # ---- start-up ----------------------------------------------------------------------------
    @property
    def cores(self) -> list[CoreProcess]:
        """The replicas' core processes, by index."""
        return self.replicas.cores

    def _wait_ready(self, timeout: float) -> EngineReady:
        """Block until every replica reported ``EngineReady`` (before the event loop runs);
        returns replica 0's."""
        return self.replicas.wait_ready(timeout, self._on_ready)[0]

    def _on_ready(self, ready: EngineReady) -> None:
        core = self.cores[ready.engine_index]
        core.state = ReplicaState.LIVE
        logger.info("%s ready (pid %s)", self.replicas.name(core.index), core.pid)
        self.stats[core.index] = ready.stats
        self.metrics.reset_engine(core.index)
        self.metrics.record_engine_stats(ready.stats, core.index)
        self.metrics.record_sleep_state(core.index, self.sleep_state.level)
        self.metrics.cache_config_info.set(core.index, self.config.cache_config,
                                           ready.num_blocks, ready.enable_prefix_caching)
        self._restarts.ready(ready)

    def _init_processors(self, ready: EngineReady) -> None:
        self.max_model_len = ready.max_model_len
        self.metrics.set_max_model_len(ready.max_model_len)
        if self.config.lora_config.enable_lora:
            self.metrics.enable_lora_info(self.config.lora_config.max_loras)
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = ready.num_blocks  # per replica
        self.task = ready.task
        self.config.find_logits_processor_plugins(ready.task)  # the core's lookup, here too
        self.processor = make_input_processor(self.config, self._front, ready)
        self.balancer = DPLoadBalancer(self.num_replicas, ready.block_size)
        sc = self.config.scheduler_config
        self.requests = OpenRequests(OutputProcessor(self.tokenizer), self.tracker,
                                     self.balancer, self.metrics, sc.admission_control,
                                     sc.stream_interval)

    async def start(self) -> None:
        """Start the output loop on the running event loop. When a core process dies or
        fails, its open streams get an ``EngineDeadError`` and ``on_dead(error)`` (if set) is
        called; once no replica is left, new requests are refused."""
        self._outputs = OutputLoop(self.replicas, self.requests, self._calls, self._restarts,
                                   self.stats, self.metrics, on_ready=self._on_ready,
                                   is_healthy=lambda: self.is_healthy,
                                   on_lost=self._replica_lost, on_broken=self._outputs_broke)

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
        await self._restarts.restart_dead(timeout)
        self._dead = None

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
        return len(self.requests.waiting)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0,
                    mm_features: list[MultiModalFeature] | None = None,
                    client_id: str = "",
                    lora_request: LoRARequest | None = None,
                    cache_salt: str | None = None,
                    prompt_embeds: PromptEmbeds | None = None,
                    data_parallel_rank: int | None = None,
                    session_id: str | None = None) -> RequestStream:
        """Validate and queue one prompt (its ``n`` samples) on one replica; returns its
        output stream. Fields ``params`` was not given take the model's sampling defaults
        (``sampling_defaults``, from its generation_config.json). ``mm_features``: the
        prompt's preprocessed images (``processor.attach_images``; placeholders already
        expanded in ``prompt_token_ids``). ``client_id`` names the sender for the fair
        policy. With admission control, await ``admitted(stream)``.
        ``lora_request``: the adapter it runs with (added with ``add_lora`` first).
        ``cache_salt``: salts its prefix-cache blocks (a non-empty string; None: unsalted).
        ``prompt_embeds``: the prompt's embedding rows (``processor.embeds_prompt``;
        ``prompt_token_ids`` are then its placeholders). ``data_parallel_rank``: the replica
        it must run on (vLLM's; None: the balancer chooses). ``session_id``: its session
        (vLLM 0.32's), written into the ``BlockStored`` KV cache events of the blocks its
        samples store (None: none; checked by the caller: the server's ``session_id``).
        A request with a ``thinking_token_budget`` or ``structured_outputs`` gets the
        markers of the constructor's ``reasoning_parser`` / ``reasoning_config`` (on a copy;
        its own ``reasoning_token_ids`` win).

        Raises:
            ValueError: for a bad prompt, parameters or ``cache_salt``, a request id in use
                or not a string, a ``priority`` that is not an integer or is nonzero under a
                policy that does not read it, a ``lora_request`` that is not a LoRARequest,
                or a ``data_parallel_rank`` that is not an integer or is outside the replicas
                (nothing queued).
            EngineDeadError: if no replica is running, or the pinned one is not.
        """
        check_request_args(request_id, priority, lora_request, data_parallel_rank)
        if not isinstance(params, SamplingParams):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"params must be a SamplingParams, got {type(params).__name__}")
        self.config.scheduler_config.check_priority(priority)
        self._check_serving()
        arrival = time.monotonic()
        params = self._reasoning.apply(params).with_defaults(self.sampling_defaults)
        requests = self.processor.make_requests(request_id, prompt_token_ids, params, arrival,
                                                priority, mm_features, client_id,
                                                lora_request, cache_salt, prompt_embeds,
                                                session_id)
        return self._queue(request_id, prompt, requests, arrival, data_parallel_rank)

    def _check_serving(self) -> None:
        """Raises EngineDeadError if no replica is running, EngineSleepingError (one) while
        the engine sleeps or waits for its weights to be reloaded."""
        if not self.is_healthy:
            raise EngineDeadError("the engine core is not running")
        refusal = self.sleep_state.refusal()
        if refusal is not None:
            raise EngineSleepingError(refusal)

    def _queue(self, request_id: str, prompt: str | None, requests: list[Request],
               arrival: float, data_parallel_rank: int | None = None) -> RequestStream:
        """Send one user request's samples to one replica (``data_parallel_rank``, else the
        balancer's choice); returns its stream.

        Raises:
            ValueError: if the request cannot be encoded, or for a ``data_parallel_rank``
                outside the replicas (nothing registered then).
            EngineDeadError: if the pinned replica is not running.
        """
        self._name_in_cores(requests)
        try:  # encode before registering anything, so a refusal leaves no state behind
            payload = self.replicas.encoder.encode(
                AddRequests([EngineCoreRequest.from_request(r) for r in requests]))
        except (msgspec.EncodeError, OverflowError, TypeError) as e:
            raise ValueError(f"request {request_id!r} cannot be encoded: {e}") from None
        try:
            replica = self.balancer.choose_for(requests[0], [c.is_live for c in self.cores],
                                               [s.kv_cache_usage for s in self.stats],
                                               data_parallel_rank)
        except RuntimeError as e:  # no replica live, or not the pinned one (dead, restarting)
            raise EngineDeadError(str(e)) from None
        stream = self.requests.open(request_id, prompt, requests, arrival, replica)
        logger.debug("request %s -> replica %d (depths %s)", request_id, replica,
                     self.balancer.depth)
        self.cores[replica].send(payload)
        return stream

    def _name_in_cores(self, requests: list[Request]) -> None:
        """Give the samples of one request ids no earlier request had in the cores (vLLM
        makes its engine ids unique too): ``{sample id}.{k}``, ``k`` counted per call (the
        caller's id stays the ``parent_id``, which the outputs, the stream and ``abort``
        use). A request id may be used again once its request ended (aborted, or finished by
        a stop string in this process) while its core still had outputs of it on the way
        (sent before the core read the abort) or, with async scheduling, a step of it in
        flight: with the same ids, those tokens were taken as the new request's."""
        k = next(self._core_ids)
        for r in requests:
            r.request_id = f"{r.request_id}.{k}"

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

    def abort(self, request_id: str | Iterable[str]) -> Completed:
        """Stop a request now, or each of several ids (vLLM's ``str | Iterable[str]``):
        no-op for one that already finished or is unknown, as a second abort; its core frees
        its KV blocks before its next step. Its stream ends: a task reading it gets a last
        output whose unfinished samples have ``finish_reason`` ``"abort"`` (vLLM's), and one
        awaiting ``admitted`` returns.

        The abort is done when this returns; the result is an already-done awaitable, so
        ``engine.abort(id)`` and vLLM 0.32's ``await engine.abort(id)`` both work.

        Raises:
            TypeError: for an id that is not a string (an iterable of them aside).
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        bad = [i for i in ids if not isinstance(i, str)]
        if bad:
            raise TypeError(f"abort: request ids are strings, got {bad[0]!r}")
        for rid in ids:
            sample_ids, replica = self.requests.cancel(rid)
            if sample_ids and replica is not None:
                self.replicas.send(replica, AbortRequests(sample_ids))
        return COMPLETED

    # ---- outputs (the loop: output_loop.py) --------------------------------------------------
    def _replica_lost(self, error: EngineDeadError, was_live: bool) -> None:
        """A replica died (its requests and calls have failed): refuse new requests once no
        replica is left; tell ``on_dead`` unless it was a restart that failed."""
        if not any(c.state is not ReplicaState.DEAD for c in self.cores):
            self._dead = error
        if was_live and self.on_dead is not None:
            self.on_dead(error)

    def _outputs_broke(self, error: Exception) -> None:
        """The output loop itself failed (it has ended): end every request, tell ``on_dead``."""
        self.fail_all(EngineDeadError(f"output loop failed: {error}"))
        if self.on_dead is not None:
            self.on_dead(self._dead)
