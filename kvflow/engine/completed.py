"""An awaitable that is already done: what a synchronous method returns so that code written
for vLLM's ``async def`` twin (``await engine.abort(id)``) runs unchanged, while callers that
ignore the result keep working and no "coroutine was never awaited" warning is raised."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any


class Completed:
    """Awaiting it returns None at once, without suspending (any event loop, or none)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # a generator: ``await`` runs it to its end at once

    def __repr__(self) -> str:
        return "Completed()"


COMPLETED = Completed()
