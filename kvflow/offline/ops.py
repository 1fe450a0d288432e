"""``LLM``'s operational methods (vLLM's): sleep mode, ``collective_rpc`` and ``apply_model``,
the prefix and multimodal caches' resets, the torch profiler, the world size and
``get_metrics``, mixed into :class:`kvflow.offline.llm.LLM`, whose ``engine`` they use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvflow.config.profiler import required_profiler_options
from kvflow.engine.core_stats import collect_stats
from kvflow.engine.dp_client import DPCoreClient
from kvflow.engine.llm_engine import LLMEngine
from kvflow.metrics_reader import Metric
from kvflow.offline.stats import OfflineStats


class LLMOps:
    """The engine operations of :class:`kvflow.offline.llm.LLM` (a mixin: ``LLM`` sets ``engine``)."""

    engine: LLMEngine
    _stats: OfflineStats | None

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory while the engine is idle: level 1 offloads the weights to
        host memory (on a CPU device they stay) and frees the KV cache; level 2 drops both
        (wake_up, then ``collective_rpc("reload_weights")``). The prefix cache is reset; a
        second sleep is a no-op. Generation is refused until :meth:`wake_up`.

        Raises:
            ValueError: without enable_sleep_mode, for a level other than 1 and 2, or while
                requests are in flight.
        """
        self.engine.local_core("sleep").sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Give back what :meth:`sleep` freed: ``tags`` "weights" and/or "kv_cache" (None:
        both); the KV cache has as many blocks as before. A no-op while awake.

        Returns:
            True when the engine is fully awake after it (every tag woken), as vLLM's
            ``LLM.wake_up``; False while a tag still sleeps.

        Raises:
            ValueError: for an unknown tag.
        """
        self.engine.local_core("wake_up").wake_up(tags)
        return not self.is_sleeping()

    def is_sleeping(self) -> bool:
        """True from :meth:`sleep` until every tag woke up."""
        return self.engine.local_core("is_sleeping").sleep_mode.is_sleeping

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run the Worker method named ``method`` on every rank (e.g. ``"reload_weights"``
        after a level-2 sleep) and return the results by rank; a callable (called as
        ``method(worker, *args, **kwargs)``) only with the in-process executor.

        ``reload_weights`` also forgets the prefix cache and the cached image embeddings
        (computed by the old weights); one whose load fails leaves the engine refusing
        requests until a reload succeeds.

        Raises:
            ValueError: for a name that is not a Worker method, a callable with worker
                processes, a ``timeout`` (not supported: calls are waited for), or whatever
                the named method raised on a rank (its type and message).
        """
        if timeout is not None:
            raise ValueError(f"collective_rpc timeout={timeout!r} is not supported; leave it "
                             "None (the call is waited for)")
        return self.engine.local_core("collective_rpc").collective_rpc(method, args, kwargs)

    def start_profile(self) -> None:
        """Start the torch profiler on every rank (vLLM's ``LLM.start_profile``): the engine
        must run with ``KVFLOW_TORCH_PROFILER_DIR`` set to the traces' folder.

        Raises:
            ValueError: with the variable unset, a profile already running, or data
                parallelism.
        """
        required_profiler_options()  # refused here, naming the variable
        self.engine.local_core("start_profile").collective_rpc("start_profile", (), None)

    def stop_profile(self) -> list[str]:
        """Stop the profiler and write one Chrome trace per rank (gzip JSON, for Perfetto).

        Returns:
            The traces' paths, by rank.

        Raises:
            ValueError: when no profile is running.
        """
        return self.engine.local_core("stop_profile").collective_rpc("stop_profile", (), None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so that the next prompts compute all their tokens
        (vLLM's ``LLM.reset_prefix_cache``; for timing runs). Between calls of ``generate``
        and the others no request is open and it always resets; from an ``on_output``
        callback it returns False and changes nothing (requests are running).

        Returns:
            True if the cache was reset (of every data-parallel replica), else False.

        Raises:
            RuntimeError: with data parallelism, if a replica failed or exited.
        """
        return self.engine.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """Forget the vision encoder's cached image and video embeddings that no running
        request needs (vLLM's ``LLM.reset_mm_cache``): a later prompt with the same image
        encodes it again. Embeddings a running request still reads stay; a no-op for a
        text-only model.

        Raises:
            ValueError: with data parallelism (not relayed to the replicas offline).
        """
        encoder = self.engine.local_core("reset_mm_cache").scheduler.encoder
        if encoder is not None:
            encoder.forget(set(encoder.unpinned))

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` on each rank's model (the ``torch.nn.Module`` the runner runs),
        results by rank (vLLM's ``LLM.apply_model``; through ``collective_rpc``). The model
        is kvflow's, not transformers': fused projections (``qkv_proj``, ``gate_up_proj``),
        and on CPU with the native GEMM kernels a linear layer's ``weight`` is empty (its
        values live packed for the kernel), so read or change those through the runner's
        own loading paths, not the parameters.

        Raises:
            ValueError: for a ``func`` that is not callable, or with worker processes
                (tensor, pipeline or context parallelism, ``distributed_executor_backend="mp"``)
                or data parallelism: kvflow sends no callable to another process (vLLM
                pickles it); name a Worker method with ``collective_rpc`` instead.
        """
        if not callable(func):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"apply_model needs a callable, got {type(func).__name__}")
        core = self.engine.local_core("apply_model")
        if not core.executor.runs_in_process:
            raise ValueError("apply_model runs only with the in-process executor (one rank, "
                             "distributed_executor_backend='uni'): kvflow sends no callable "
                             "to a worker process")
        return self.collective_rpc(lambda worker: func(worker.runner.model))

    def get_world_size(self, include_dp: bool = True) -> int:
        """The processes one engine runs on, tensor x pipeline x context parallel (vLLM's
        ``LLM.get_world_size``), times ``data_parallel_size`` with ``include_dp``."""
        pc = self.engine.config.parallel_config
        return pc.world_size * (pc.data_parallel_size if include_dp else 1)

    def release_kv_cache_memory(self) -> None:
        """vLLM's ``LLM.release_kv_cache_memory`` (free the KV cache after
        ``sleep(level=0)``, keeping paused requests): refused, kvflow has no level-0 sleep.

        Raises:
            ValueError: always, naming what frees the KV cache in kvflow.
        """
        raise ValueError("release_kv_cache_memory needs vLLM's sleep(level=0) (scheduling "
                         "paused with requests kept), which kvflow does not have: with "
                         "enable_sleep_mode=True, sleep(level=1) then "
                         "wake_up(tags=['weights']) leaves only the KV cache freed, and "
                         "wake_up(tags=['kv_cache']) gives it back")

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics (vLLM's ``LLM.get_metrics``): the series
        ``/metrics`` serves, named as vLLM names them where vLLM has them
        (``vllm:num_requests_running``, ``vllm:prompt_tokens``,
        ``vllm:time_to_first_token_seconds``, ...; kvflow's own keep ``kvflow:``), as
        :mod:`kvflow.metrics_reader`'s ``Counter``, ``Gauge``, ``Histogram`` and ``Vector``
        (vLLM's ``vllm.v1.metrics.reader`` classes); the engine's gauges and counters as
        they are now, the per-request ones over every request since the LLM started.

        Raises:
            ValueError: unless the LLM was made with ``disable_log_stats=False`` (vLLM's
                rule: its offline LLM records no metrics by default).
        """
        if self._stats is None:
            raise ValueError("get_metrics needs LLM(..., disable_log_stats=False): as in "
                             "vLLM, the offline LLM records no metrics by default")
        core = self.engine.core
        stats = list(core.stats) if isinstance(core, DPCoreClient) else [collect_stats(core)]
        return self._stats.snapshot(stats)
