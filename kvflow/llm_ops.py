"""``LLM``'s operational methods (vLLM's): sleep mode, ``collective_rpc``, the prefix cache's
reset and the torch profiler, mixed into :class:`kvflow.llm.LLM`, whose ``engine`` they use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvflow.config.profiler import required_profiler_options
from kvflow.engine.llm_engine import LLMEngine


class LLMOps:
    """The engine operations of :class:`kvflow.llm.LLM` (a mixin: ``LLM`` sets ``engine``)."""

    engine: LLMEngine

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

        Raises:
            ValueError: for a name that is not a Worker method, a callable with worker
                processes, or a ``timeout`` (not supported: calls are waited for).
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
