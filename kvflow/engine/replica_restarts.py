"""Replacing dead engine-core replicas while the others keep serving (``kvflow serve
--engine-failure restart``): a new core process per dead replica, and a future per replica
restarting that its ``EngineReady`` resolves (or its death, when the new process fails too).
Used on the event loop only."""

from __future__ import annotations

import asyncio

from kvflow.engine.core_client import ReplicaState
from kvflow.engine.messages import EngineReady
from kvflow.engine.replica_set import ReplicaSet


class ReplicaRestarts:
    """The restarts of one ``ReplicaSet``'s replicas in progress.

    Args:
        replicas: the replicas (their cores' states say which are dead).
    """

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._ready_events: dict[int, asyncio.Future] = {}  # replica index -> its restart

    async def restart_dead(self, timeout: float) -> None:
        """Replace every dead replica by a new core process (same config; the model loads
        again) and wait until each is ready; replicas that die meanwhile are replaced too.

        Raises:
            RuntimeError: if a new core fails to start or to report within ``timeout``
                seconds (that replica stays dead).
        """
        while dead := [c for c in self.replicas.cores if c.state is ReplicaState.DEAD]:
            for old in dead:
                self._ready_events[old.index] = asyncio.get_running_loop().create_future()
                self.replicas.respawn(old.index)
            for old in dead:
                await self._wait_restarted(old.index, timeout)

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
            raise RuntimeError(f"{self.replicas.name(index)} did not restart within "
                               f"{timeout:.0f} s") from None
        core = self.replicas.cores[index]
        if core.state is not ReplicaState.LIVE:
            raise RuntimeError(f"{self.replicas.name(index)} failed to restart: {core.death}")

    def ready(self, ready: EngineReady) -> None:
        """A replica reported ready: end its restart (no-op when none is in progress)."""
        future = self._ready_events.pop(ready.engine_index, None)
        if future is not None and not future.done():
            future.set_result(ready)

    def died(self, index: int) -> None:
        """Replica ``index`` died: end its restart, as failed (no-op when none is in
        progress)."""
        future = self._ready_events.pop(index, None)
        if future is not None and not future.done():
            future.set_result(None)
