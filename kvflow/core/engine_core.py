"""EngineCore: the schedule -> execute -> update loop over one model.

Offline use (``LLM``) drives it in-process; the server runs the same class in its own process.
Its parts, one job each: ``engine_startup`` (building the platform, model, executor, KV cache,
scheduler, ...: EngineCore's base class), ``engine_dtype`` (the compute dtype),
``kv_cache_sizing`` (the KV-cache config), ``kv_connector_startup`` (the KV connector's
scheduler half) and ``engine_steps`` (the step variants: lock-step, async, pipelined).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvflow.config import EngineConfig
from kvflow.core.engine_startup import EngineCoreStartup
from kvflow.core.engine_steps import (
    fold_oldest_batch,
    step_async,
    step_sync,
    step_with_batch_queue,
)
from kvflow.core.kv_events import KVEventBatch
from kvflow.core.request_errors import (
    LORA_REQUEST,
    MULTI_MODAL_DATA,
    PROMPT_EMBEDS,
    STRUCTURED_OUTPUTS,
    RequestError,
)
from kvflow.core.sleep_mode import EngineSleep
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.executor.base import ExecutorError
from kvflow.inputs.embeds import check_packed_prompt_embeds
from kvflow.inputs.multimodal import check_mm_features
from kvflow.lora.request import LoRARequest, already_loaded
from kvflow.models.model_resolver import ModelSource, resolve_model
from kvflow.models.pooling_config import task_mismatch
from kvflow.request import Request, RequestStatus
from kvflow.structured.reasoning_gate import ReasoningGate
from kvflow.worker.worker import RpcRefusal

logger = logging.getLogger(__name__)

_IDLE_GAP_S = 0.05  # a longer pause between two steps is idle time, not step time


class EngineCore(EngineCoreStartup):
    """Owns the scheduler, the KV-cache manager and the executor.

    Construction reads as a checklist: platform, model config, executor (starts the workers,
    which load the weights), KV cache (sized after the model is loaded), scheduler.

    Raises:
        ValueError: for an unknown model, unsupported architecture, impossible cache size, or
            parallel sizes the model does not split into.
        ExecutorError: if a worker process fails to start.
    """

    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        self.config = config
        self._init_platform()
        mc = config.model_config
        self._init_model(source or resolve_model(mc.model, mc.download_dir, mc.revision, mc.hf_token))
        self._init_kv_cache()
        self._init_scheduler()
        self._init_structured_output()
        self._init_kv_events()
        self.sleep_mode = EngineSleep(config.model_config.enable_sleep_mode)
        self.executor.freeze_worker_heaps()  # worker processes only (kvflow/runtime/gc_heap.py)

    def publish_kv_events(self) -> None:
        """Send the KV cache events recorded since the last batch (none: nothing sent)."""
        events = self.kv_cache_manager.take_kv_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(
                ts=time.time(), events=events,
                data_parallel_rank=self.config.parallel_config.data_parallel_rank))

    def mark_restarted(self) -> None:
        """This core replaces one that died (``--engine-failure restart``): with KV cache
        events on, its first batch begins with ``AllBlocksCleared``, so that a KV-aware
        router drops the blocks the dead core published (they died with it). The new
        publisher numbers its batches from 0 again: the dead core's last sequence number
        is not known (its batches go from its own process straight to the subscribers);
        the ``AllBlocksCleared`` marks the restart, and the dead core's replay buffer is
        gone. The event leads the batch of the core's first step, not a batch of its own at
        start-up: a subscriber reconnects to the new publisher's socket only some time
        after it binds, and PUB drops what is sent before then."""
        if self.kv_event_publisher is not None:
            self.kv_cache_manager.record_all_blocks_cleared()

    # ---- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter on every rank (read and checked against the model) unless it
        is loaded.

        Raises:
            ValueError: without enable_lora, for an id in use by another adapter, or for an
                adapter the model cannot apply (a rank above max_lora_rank, target modules
                kvflow cannot adapt, wrong shapes).
        """
        if already_loaded(self.loras, lora_request, self.config.lora_config.enable_lora):
            return
        self.drain_steps()
        # every rank; requests finished since the last step hold their adapters no more
        results = self.executor.collective_rpc("add_lora", lora_request,
                                               self.scheduler.finished_unsent())
        refused = next((r for r in results if isinstance(r, RpcRefusal)), None)
        if refused is not None:
            # pipeline stages check only their own layers' weights: the stages that took
            # it forget it, or the id reused for another folder would find it there
            if not all(isinstance(r, RpcRefusal) for r in results):
                self.executor.collective_rpc("remove_lora", lora_request.lora_int_id)
            raise ValueError(refused.message)
        self.loras[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter on every rank (requests running with it finish with it);
        False if it was not loaded. No block its weights filled serves a hit after it (its
        folder may hold other weights at its next load: ``KVCacheManager.forget_adapter``).
        """
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self.drain_steps()
        self.executor.collective_rpc("remove_lora", lora_int_id)
        self.kv_cache_manager.forget_adapter(lora_int_id, {
            rid for rid, r in self.scheduler.requests.items()
            if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id})
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
        return True

    def drain_steps(self) -> None:
        """Wait for the micro-batches in flight (pipeline parallelism) and fold their tokens
        in, keeping their outputs for the next ``step``: a ``collective_rpc`` must not
        interleave with step replies. Nothing to do without steps in flight.

        Raises:
            ExecutorError: if a worker failed (every step in flight is failed).
        """
        while self.batch_queue:
            self.drained_outputs.extend(fold_oldest_batch(self))

    # ---- sleep mode (core/sleep_mode.py) ---------------------------------------------------
    # Each call below reaches every rank, so the micro-batches in flight are folded in first
    # (``drain_steps``): with pipeline parallelism one may be, even on an idle engine (its
    # requests aborted meanwhile), and the executor refuses a call while steps are in flight.
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and offload (level 1) or drop (level 2) the weights on every
        worker; needs an idle engine (see :meth:`EngineSleep.sleep` for what is raised)."""
        self.drain_steps()
        self.sleep_mode.sleep(self, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` ("weights", "kv_cache"; None: both); see :meth:`EngineSleep.wake_up`."""
        self.drain_steps()
        self.sleep_mode.wake_up(self, tags)

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None
                       ) -> list[Any]:
        """A Worker method on every rank, results by rank (see
        :meth:`EngineSleep.collective_rpc` for what is raised)."""
        self.drain_steps()
        return self.sleep_mode.collective_rpc(self, method, args, kwargs)

    # ---- prefix cache ------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: later prompts compute all their tokens again (vLLM's
        ``reset_prefix_cache``; benchmarks call it between runs). Refused while any request
        is unfinished: its blocks are indexed as they fill and would serve hits once it ends,
        so the reset would be partial; running requests are never touched either way.

        With KV cache events on, the reset's events (``AllBlocksCleared``) go out now.

        Returns:
            True once the cache is empty; False (nothing changed) while requests are
            unfinished.
        """
        if self.scheduler.has_unfinished_requests():
            return False
        self.kv_cache_manager.reset_prefix_cache()
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
        return True

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request (see InputProcessor). A constrained request starts its
        grammar compile now and is scheduled once it is ready; a request's LoRA adapter is
        loaded first if it is not yet.

        Raises:
            ValueError: for a duplicate id, a prompt at max_model_len, an engine asleep
                (or whose weights a level-2 sleep dropped), a generation request to an
                embedding engine (and the reverse); a ``RequestError`` (a ValueError
                naming the part of the request at fault in its ``field``) for structured
                outputs on an engine without a tokenizer, images for a text-only model or
                images that do not hold what they say,
                a LoRA adapter that cannot be loaded (a corrupt or truncated
                ``adapter_model.safetensors``, a rank above ``max_lora_rank``, ...), or
                prompt embeddings to an engine without ``enable_prompt_embeds``, or rows
                the model cannot take (the front end refuses them first).
            ExecutorError: if a worker failed while loading the request's LoRA adapter
                (the engine's failure, not the request's).
        """
        refusal = self.sleep_mode.refusal()
        if refusal is not None:
            raise ValueError(f"request {request.request_id!r} refused: {refusal}")
        asked = "generate" if request.pooling_params is None else request.pooling_params.task
        served = (self.task,) if self.pooler_config is None else self.pooler_config.tasks
        if asked not in served:
            raise ValueError(task_mismatch(self.task, asked, self.pooler_config and
                                           self.pooler_config.num_labels or 0))
        if request.prompt_embeds is not None:
            self._check_prompt_embeds(request)
        if request.mm_features is not None:
            self._check_mm_features(request)
        if request.lora_request is not None:
            self._add_request_lora(request)
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            if self.config.model_config.skip_tokenizer_init:
                raise RequestError("structured outputs need a tokenizer (skip_tokenizer_init "
                                   "is set)", STRUCTURED_OUTPUTS)
            params = request.sampling_params
            # the grammar starts after the reasoning unless it applies in it too (vLLM's
            # enable_in_reasoning), where the markers serve the thinking_token_budget alone
            markers = None if params.grammar_in_reasoning else params.reasoning_token_ids
            gate = None if markers is None else \
                ReasoningGate(markers, [] if request.prompt_embeds is not None
                              else request.prompt_token_ids)  # embeds: placeholder ids
            request.structured_output = self.structured_output.request_state(
                structured, request.request_id, request.sampling_params.allowed_token_ids,
                gate)
        self.scheduler.add_request(request)

    def _check_mm_features(self, request: Request) -> None:
        """Raises RequestError (field ``multi_modal_data``) for images to a text-only model,
        or images that do not hold what they say (``check_mm_features``); the front end
        checks them first, this keeps images that would fail a step out of the scheduler."""
        if self.scheduler.encoder is None:
            raise RequestError(f"request {request.request_id!r} has images but this model "
                               "takes text only", MULTI_MODAL_DATA)
        try:
            check_mm_features(request.mm_features, len(request.prompt_token_ids))
        except ValueError as e:
            raise RequestError(f"request {request.request_id!r}: {e}", MULTI_MODAL_DATA) \
                from None

    def _check_prompt_embeds(self, request: Request) -> None:
        """Raises RequestError (field ``prompt_embeds``) when the engine takes no prompt
        embeddings, or ``request``'s rows are not ones the model can take (one per prompt
        token, of its hidden size: ``check_packed_prompt_embeds``); the front end checks
        them first, this keeps rows that would fail a step out of the scheduler."""
        rid, embeds = request.request_id, request.prompt_embeds
        if not self.config.model_config.enable_prompt_embeds:
            raise RequestError(f"request {rid!r} has prompt_embeds but the engine was "
                               "started without enable_prompt_embeds", PROMPT_EMBEDS)
        try:
            check_packed_prompt_embeds(embeds, self.hf_config.hidden_size)
            if len(request.prompt_token_ids) != embeds.num_tokens:
                raise ValueError(f"{len(request.prompt_token_ids)} placeholder ids for "
                                 f"{embeds.num_tokens} prompt_embeds rows")
        except ValueError as e:
            raise RequestError(f"request {rid!r}: {e}", PROMPT_EMBEDS) from None

    def _add_request_lora(self, request: Request) -> None:
        """Load the adapter ``request`` runs with unless it is loaded.

        Raises:
            RequestError: (field ``lora_request``) naming the adapter (its name, or its
                file) and why it cannot be loaded.
        """
        lora = request.lora_request
        try:
            self.add_lora(lora)
        except ExecutorError:  # WorkerConfigError is a ValueError too: not the request's
            raise
        except ValueError as e:
            named = repr(lora.lora_name) in str(e) or lora.lora_path in str(e)
            raise RequestError(str(e) if named else f"LoRA adapter {lora.lora_name!r}: {e}",
                               LORA_REQUEST) from None

    def admission_verdict(self, requests: list[Request]) -> float | None:
        """Admission control for the samples of one prompt: None to accept them, else the
        seconds after which to retry (see ``Scheduler.admission_verdict``)."""
        return self.scheduler.admission_verdict(requests[0])

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """Stop requests now and free their KV blocks (unknown ids are ignored).
        ``stopped``: a stop string ended them (the output processor matched it): they
        finish as stopped, their phases recorded for the metrics, not as aborted."""
        self.scheduler.finish_requests(
            request_ids, RequestStatus.FINISHED_STOPPED if stopped
            else RequestStatus.FINISHED_ABORTED)
        self.structured_output.forget(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished or outputs wait for the next ``step``."""
        return self.scheduler.has_unfinished_requests() or bool(self.drained_outputs)

    def check_health(self) -> None:
        """Raise ExecutorError if a worker has failed (for an idle engine's periodic check)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's workers and the KV event publisher (idempotent)."""
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule a batch, run the model on it, and fold the sampled tokens back in: one
        of the step variants (``kvflow/core/engine_steps.py``), by how the executor runs."""
        failed = self._finish_failed_compiles()
        failed, self.drained_outputs = failed + self.drained_outputs, []
        if self.executor.max_concurrent_batches > 1:
            outputs = step_with_batch_queue(self)
        else:
            self._time_last_step(time.perf_counter())
            outputs = step_async(self) if self.scheduler.async_scheduling else step_sync(self)
            self._last_step = (self._last_step[0], time.perf_counter())
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
        ended = [o.request_id for o in outputs if o.error is not None]
        if ended:  # requests that failed alone in the step (core/sched_failures.py)
            self.structured_output.forget(ended)
        return failed + outputs

    def _finish_failed_compiles(self) -> list[EngineCoreOutput]:
        """End the waiting requests whose grammar compile failed or passed its time limit,
        or whose ``allowed_token_ids`` miss every token their grammar allows first:
        finish_reason ``abort`` with the error (the API answers it with a 400). They were
        never scheduled, so they hold no KV blocks."""
        outputs = []
        for request_id, message in self.structured_output.take_failed():
            request = self.scheduler.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            logger.warning("request %s: %s", request_id, message)
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason="abort",
                                            error=message, error_field=STRUCTURED_OUTPUTS))
        return outputs

    def _time_last_step(self, now: float) -> None:
        """Report the previous step's duration to the scheduler's step-time model: from its
        start to this step's start (what separates two tokens, the loop's own work
        included), or to its end when the engine idled in between."""
        last, self._last_step = self._last_step, (now, now)
        if last is not None:
            start, end = last
            self.scheduler.record_step_time(now - start if now - end < _IDLE_GAP_S
                                            else end - start)
