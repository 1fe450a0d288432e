"""Calls from the API process to every live engine-core replica that wait for an answer
(``AddLoRA`` / ``RemoveLoRA`` / ``ResetPrefixCache`` / ``Sleep`` / ``WakeUp`` /
``CollectiveRPC``, answered by ``UtilityResult``), matched by ``call_id``."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec

from kvflow.engine.messages import UtilityCall, UtilityResult
from kvflow.engine.replica_set import ReplicaSet


class UtilityCalls:
    """The calls awaiting answers: call id -> (replica index, future of its UtilityResult).
    Used on the event loop only."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}
        self._call_ids = itertools.count()

    async def call(self, replicas: ReplicaSet, msg: UtilityCall) -> list[Any]:
        """Send ``msg`` to every live replica (each with its own ``call_id``) and wait for
        all answers; returns their ``result`` values, by replica (None for calls without one).

        Raises:
            ValueError: the first refusal's message.
            EngineDeadError: if a replica dies first (see :meth:`fail`).
        """
        futures = []
        for core in replicas.cores:
            if core.is_live:
                call_id = next(self._call_ids)
                future = asyncio.get_running_loop().create_future()
                self._calls[call_id] = (core.index, future)
                replicas.send(core.index, msgspec.structs.replace(msg, call_id=call_id))
                futures.append(future)
        answers: list[UtilityResult] = await asyncio.gather(*futures)
        error = next((a.error for a in answers if a.error is not None), None)
        if error is not None:
            raise ValueError(error)
        return [a.result for a in answers]

    def answer(self, msg: UtilityResult) -> None:
        """Resolve the call ``msg`` answers (unknown ids are ignored)."""
        _, future = self._calls.pop(msg.call_id, (None, None))
        if future is not None and not future.done():
            future.set_result(msg)

    def fail(self, error: BaseException, replica: int | None = None) -> None:
        """End the calls waiting on ``replica`` (every replica: None) with ``error``."""
        for call_id, (index, future) in list(self._calls.items()):
            if replica is None or index == replica:
                del self._calls[call_id]
                if not future.done():
                    future.set_exception(error)
