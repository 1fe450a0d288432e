"""The executor interface: runs one engine's workers (one per rank) for the engine core.

Three implementations share it: ``uniproc`` (one rank, in the engine's process), ``multiproc``
(one worker process per rank on this machine) and ``ray`` (one Ray actor per rank, across
machines). All of them run the same :class:`kvflow.worker.worker.Worker` code on every rank;
only how a call reaches the ranks differs. Start-up calls go to every rank
(:meth:`Executor.collective_rpc`); a step's ``SchedulerOutput`` is sent to every rank once per
step and only the driver rank (TP rank 0 of the last pipeline stage) returns its sampled
tokens.

With pipeline parallelism an executor accepts up to ``max_concurrent_batches`` steps before
the first one's result is asked for (:meth:`execute_model_async`), so the stages work on
different micro-batches at the same time.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NoReturn

from kvflow.config import EngineConfig
from kvflow.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from kvflow.sched_output import DraftGrammar, GrammarBitmask, SchedulerOutput

logger = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """A worker failed (died, or raised); the executor has shut every worker down and takes
    no more calls."""


class WorkerConfigError(ExecutorError, ValueError):
    """A worker raised ``ValueError`` while the engine was being set up (building and loading
    its part of the model, sizing or allocating its KV cache): bad input, as the same error
    is in one process (``kvflow`` exits 2 with one line); the executor has shut every worker
    down."""


class StepFuture:
    """The pending result of one ``execute_model_async`` call.

    Args:
        resolve: called once, by the first ``result()``, to wait for the value.
    """

    def __init__(self, resolve: Callable[[], Any]) -> None:
        self._resolve: Callable[[], Any] | None = resolve
        self._value: Any = None

    @classmethod
    def done(cls, value: Any) -> StepFuture:
        """A future that already holds ``value``."""
        future = cls(lambda: value)
        future.result()
        return future

    def result(self) -> Any:
        """The step's result (the runner's ``execute_model`` value on the driver rank).

        Raises:
            ExecutorError: if a worker failed before the result arrived.
        """
        if self._resolve is not None:
            resolve, self._resolve = self._resolve, None
            self._value = resolve()
        return self._value


class Executor(ABC):
    """Runs the workers of one engine.

    Args:
        config: the engine config (``parallel_config`` says how many ranks).
        source / hf_config / dtype: the resolved model, its HF config and compute dtype,
            handed to every worker.
    """

    # Steps that may be in flight at once (pipeline stages busy with different micro-batches).
    max_concurrent_batches: int = 1
    # Whether the step can be split (launch_forward / collect_output / launch_sampling) for
    # async scheduling.
    supports_async_scheduling: bool = False
    # Whether the workers run in the caller's process (collective_rpc may then pass a
    # callable, not only a Worker method's name).
    runs_in_process: bool = False
    # Whether one step at a time can be split launch_forward -> proposed_drafts ->
    # launch_sampling -> collect_output, so the engine core fills constrained requests'
    # grammar rows after a draft model's proposal (core/engine_steps.execute_with_grammar).
    splits_draft_steps: bool = False

    def __init__(self, config: EngineConfig, source: Any, hf_config: Any, dtype: Any) -> None:
        self.config = config
        self.source, self.hf_config, self.dtype = source, hf_config, dtype
        self._failed: str | None = None  # why the workers were shut down (see _fail)

    def _check_failed(self) -> None:
        """Refuse any call once a worker has failed.

        Raises:
            ExecutorError: with the failure's message, if ``_fail`` ran before.
        """
        if self._failed is not None:
            raise ExecutorError(self._failed)

    def _fail(self, message: str) -> NoReturn:
        """Shut the workers down and raise ExecutorError(message), now and from every later
        call (``_check_failed``); multi-worker executors call it when a worker fails.

        Raises:
            ExecutorError: always.
        """
        self._failed = f"{message}; the engine's workers were shut down"
        logger.error("%s", self._failed)
        self.shutdown()
        raise ExecutorError(self._failed)

    def _fail_config(self, rank: int, message: str) -> NoReturn:
        """A worker's set-up ``ValueError`` (``message`` without its type): shut the
        workers down and raise it as bad input, naming the rank.

        Raises:
            WorkerConfigError: always.
        """
        self._failed = f"{message} (worker rank {rank}, at engine start-up)"
        self.shutdown()
        raise WorkerConfigError(self._failed)

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank; returns the results by rank.

        Raises:
            ExecutorError: if a worker fails meanwhile.
        """

    @abstractmethod
    def execute_model_async(self, sched: SchedulerOutput,
                            grammar_bitmask: GrammarBitmask | None = None) -> StepFuture:
        """Send one step to every rank; the future holds the driver rank's result. Futures
        must be resolved in the order the steps were sent.

        Raises:
            ExecutorError: if a worker has failed.
        """

    def execute_model(self, sched: SchedulerOutput,
                      grammar_bitmask: GrammarBitmask | None = None) -> Any:
        """One step, waited for: the sampled tokens of the requests that sampled.

        Raises:
            ExecutorError: if a worker fails meanwhile.
        """
        return self.execute_model_async(sched, grammar_bitmask).result()

    def launch_forward(self, sched: SchedulerOutput,
                       first_grammar: GrammarBitmask | None = None,
                       draft_grammar: DraftGrammar | None = None) -> None:
        """Async scheduling (and a split draft-model step): apply the step and launch its
        forward pass (not waited for); ``first_grammar``: constrained requests' grammar rows
        before their first draft (a draft model chooses draft 1 within them), or None;
        ``draft_grammar``: the rows of their later drafts, asked for while the draft model
        proposes (an executor with worker processes answers their requests for them in
        ``proposed_drafts``), or None.

        Raises:
            NotImplementedError: where neither ``supports_async_scheduling`` nor
                ``splits_draft_steps`` is True.
        """
        raise NotImplementedError("this executor does not split steps (async scheduling)")

    def proposed_drafts(self) -> dict[str, list[int]]:
        """The draft model's tokens for the step ``launch_forward`` launched: request id ->
        its draft tokens (what the step's ``-1`` placeholders became); empty without a draft
        model or drafts. Valid until the next ``launch_forward``.

        Raises:
            NotImplementedError: where ``splits_draft_steps`` is False.
        """
        raise NotImplementedError("this executor does not split steps")

    def launch_sampling(self, grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Async scheduling: launch the sampling of the step ``launch_forward`` started.

        Raises:
            NotImplementedError: where neither ``supports_async_scheduling`` nor
                ``splits_draft_steps`` is True.
        """
        raise NotImplementedError("this executor does not split steps (async scheduling)")

    def collect_output(self) -> Any:
        """Async scheduling: wait for the last sampled step's tokens and return them.

        Raises:
            NotImplementedError: where neither ``supports_async_scheduling`` nor
                ``splits_draft_steps`` is True.
        """
        raise NotImplementedError("this executor does not split steps (async scheduling)")

    def discard_output(self) -> None:
        """Async scheduling: drop a launched or sampled step whose requests were aborted.

        Raises:
            NotImplementedError: where neither ``supports_async_scheduling`` nor
                ``splits_draft_steps`` is True.
        """
        raise NotImplementedError("this executor does not split steps (async scheduling)")

    @property
    def weight_bytes(self) -> int:
        """Bytes the loaded weights occupy (as stored), summed over the ranks."""
        return sum(self.collective_rpc("weight_bytes"))

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Every attention layer's KV-cache spec (KV heads per TP rank), in model order: the
        pipeline stages' layers one after the other."""
        merged: dict[str, KVCacheSpec] = {}
        for specs in self.collective_rpc("get_kv_cache_spec"):
            merged.update(specs)
        return merged

    def determine_available_memory(self, kv_cache_groups: tuple[KVCacheGroupSpec, ...]) -> int:
        """KV-cache bytes per whole block table's worth of layers that every rank can hold:
        the smallest over the ranks (see :meth:`Worker.determine_available_memory`)."""
        return min(self.collective_rpc("determine_available_memory", kv_cache_groups))

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate every rank's KV tensors for the pool the engine core sized.

        Raises:
            ValueError: if an explicitly sized cache does not fit (uniproc), or
            ExecutorError: if a worker fails (multi-process).
        """
        self.collective_rpc("initialize_kv_cache", kv_cache_config)

    def capture_graphs(self, max_model_len: int) -> None:
        """Capture CUDA graphs on every rank (a no-op where graphs are off)."""
        self.collective_rpc("capture_graphs", max_model_len)

    def freeze_worker_heaps(self) -> None:
        """Freeze each worker process's start-up heap out of the garbage collector's reach
        (:mod:`kvflow.runtime.gc_heap`), once the engine is set up. Executors whose worker runs in the
        caller's process (uniproc) leave it alone.

        Raises:
            ExecutorError: if a worker fails.
        """
        self.collective_rpc("freeze_startup_heap")

    @property
    def health_check_interval_s(self) -> float:
        """How often (seconds) an idle engine should call :meth:`check_health`: every
        second, or a quarter of ``worker_heartbeat_timeout`` where workers send heartbeats
        (``mp``, ``ray``): their monitor forgives a gap of more than half the timeout between
        checks, so an idle engine checking once a second never judged a 2 s timeout."""
        return 1.0

    def check_health(self) -> None:
        """Raise if a worker has failed (cheap: called by an idle engine every
        :attr:`health_check_interval_s`).

        Raises:
            ExecutorError: naming the failed rank.
        """

    def shutdown(self) -> None:
        """Stop the workers and release their resources (idempotent)."""
