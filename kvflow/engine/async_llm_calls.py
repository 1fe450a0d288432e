"""The calls :class:`kvflow.engine.async_llm.AsyncLLM` sends every engine-core replica and
waits for (``UtilityCall`` messages answered by ``UtilityResult``): LoRA adapters, sleep mode,
``collective_rpc`` (the torch profiler's start and stop too) and the prefix-cache reset.
AsyncLLM's base class."""

from __future__ import annotations

import logging

from kvflow.core.sleep_mode import check_wake_tags, weights_missing
from kvflow.engine.messages import (
    AddLoRA,
    CollectiveRPC,
    RemoveLoRA,
    ResetPrefixCache,
    Sleep,
    UtilityCall,
    WakeUp,
)
from kvflow.engine.request_args import check_call
from kvflow.engine.streams import EngineDeadError
from kvflow.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# the AsyncLLM method each call message comes from, as its argument errors name it
_CALL_NAMES = {AddLoRA: "add_lora", RemoveLoRA: "remove_lora", Sleep: "sleep",
               WakeUp: "wake_up", CollectiveRPC: "collective_rpc",
               ResetPrefixCache: "reset_prefix_cache"}


class AsyncLLMCalls:
    """The replica-wide calls of :class:`~kvflow.engine.async_llm.AsyncLLM`, which sets
    ``replicas``, ``requests``, ``sleep_state``, ``metrics``, ``num_replicas``, ``_calls`` and
    ``is_healthy`` that these use."""

    # ---- LoRA adapters -----------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter in the engine core, on every data-parallel replica (read and
        checked against the model there); a load any replica refuses is undone on the others.

        Raises:
            ValueError: when the engine refuses it (the message says why), or for a
                ``lora_request`` that is not a LoRARequest.
            EngineDeadError: if the engine is gone.
        """
        check_call("add_lora", AddLoRA(0, lora_request))  # before the undo below reads it
        try:
            await self._call(AddLoRA(0, lora_request))  # each replica's call gets its own id
        except ValueError:
            if len(self.replicas.cores) > 1:  # the replicas that accepted it forget it
                await self._call(RemoveLoRA(0, lora_request.lora_int_id))
            raise

    async def remove_lora(self, lora_int_id: int) -> None:
        """Forget a LoRA adapter in the engine core, on every replica (running requests finish
        with it).

        Raises:
            ValueError: for a ``lora_int_id`` that is not an integer.
            EngineDeadError: if the engine is gone.
        """
        await self._call(RemoveLoRA(0, lora_int_id))

    async def _call(self, msg: UtilityCall) -> list:
        """Send the call to every live replica and wait for all answers (their results, by
        replica); the first refusal is raised as a ValueError, as is an argument of a type
        the engine core could not decode (it would drop the call, never answering)."""
        check_call(_CALL_NAMES[type(msg)], msg)
        if not self.is_healthy:
            raise EngineDeadError("the engine core is not running")
        return await self._calls.call(self.replicas, msg)

    # ---- sleep mode (core/sleep_mode.py) -----------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Put every replica to sleep (see ``LLM.sleep``); a no-op if it sleeps already.
        New requests are refused from the moment the call is sent: one sent to a replica
        behind it would find the engine asleep there (the core's refusal, an empty
        ``abort`` answered 200).

        Raises:
            ValueError: without enable_sleep_mode, for a bad level (an integer other than 1
                and 2, or another type), or while requests are
                open (their streams, or a replica's own check).
            EngineDeadError: if the engine is gone.
        """
        if self.requests.streams and not self.sleep_state.is_sleeping:
            raise ValueError(f"cannot sleep with {len(self.requests.streams)} request(s) in "
                             "flight: sleep needs an idle engine (wait for them to finish, "
                             "or abort them)")
        self.sleep_state.falling_asleep = True
        logger.info("sleep(level=%s): sent to the engine; new requests are refused", level)
        try:
            await self._call(Sleep(0, level))
        finally:
            self.sleep_state.falling_asleep = False
        self.sleep_state.record_sleep(level)
        self._record_sleep_metrics()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake ``tags`` ("weights", "kv_cache"; None: both) on every replica.

        Returns:
            True when every tag is awake after it (vLLM's ``AsyncLLM.wake_up``), False
            while one still sleeps.

        Raises:
            ValueError: for an unknown tag, or ``tags`` that are not a list of strings.
            EngineDeadError: if the engine is gone.
        """
        await self._call(WakeUp(0, tags))
        self.sleep_state.record_wake_up(check_wake_tags(tags))
        self._record_sleep_metrics()
        return not self.sleep_state.is_sleeping

    def _record_sleep_metrics(self) -> None:
        """/metrics' sleep state of every replica: asleep at the mirrored level until every
        tag woke up (vLLM's ``engine_sleep_state``)."""
        for index in range(self.num_replicas):
            self.metrics.record_sleep_state(index, self.sleep_state.level)

    async def collective_rpc(self, method: str, args: list | None = None,
                             kwargs: dict | None = None) -> list:
        """The Worker method named ``method`` on every rank of every replica; results by
        replica, each a list by rank (``reload_weights`` also ends a level-2 sleep's
        refusals; one whose load failed starts them, as the replicas do).

        Raises:
            ValueError: for a name that is not a Worker method (or not a string), ``args``
                that are not a list or tuple, ``kwargs`` that are not a dict, other bad
                ``args`` / ``kwargs``,
                what the method raised, or results that are not plain data.
            EngineDeadError: if the engine is gone.
        """
        if args is not None and not isinstance(args, (list, tuple)):
            raise ValueError(
                f"collective_rpc: args={args!r:.60} must be a list or tuple, got "
                f"{type(args).__name__}")
        try:
            results = await self._call(CollectiveRPC(0, method, list(args or []), kwargs))
        except ValueError:
            if method == "reload_weights":  # a rank whose load failed has no weights now
                sizes = await self._call(CollectiveRPC(0, "weight_bytes", [], None))
                if any(weights_missing(replica) for replica in sizes):
                    self.sleep_state.weights_dropped = True
            raise
        if method == "reload_weights":
            self.sleep_state.weights_dropped = False
        return results

    # ---- torch profiler (worker/profiler.py) -------------------------------------------------
    async def start_profile(self) -> None:
        """Start the torch profiler on every rank of every replica (the engine runs with
        ``KVFLOW_TORCH_PROFILER_DIR`` set).

        Raises:
            ValueError: with profiling off or a profile already running.
            EngineDeadError: if the engine is gone.
        """
        await self.collective_rpc("start_profile")

    async def stop_profile(self) -> list[str]:
        """Stop the profiler everywhere; returns the traces' paths (replica by replica, rank
        by rank).

        Raises:
            ValueError: when no profile is running.
            EngineDeadError: if the engine is gone.
        """
        return [path for replica in await self.collective_rpc("stop_profile") for path in replica]

    # ---- prefix cache ------------------------------------------------------------------------
    async def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes of every live replica (``EngineCore.reset_prefix_cache``;
        a replica with unfinished requests refuses and keeps its cache).

        Returns:
            True if every replica reset its cache, False if any refused.

        Raises:
            EngineDeadError: if the engine is gone.
        """
        return all(await self._call(ResetPrefixCache(0)))
