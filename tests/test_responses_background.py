"""The background-mode pieces without a server: ``ResponseStore`` holds running responses
(never dropped; at most ``capacity``), ``EventLog`` replays and follows events, and
``BackgroundRuns`` aborts, cancels and reports each run once. Oracles: hand-written
contents, orders and call counts."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.engine.async_llm import EngineDeadError, RequestRefused
from kvflow.entrypoints.protocol.responses_api import ResponseObject
from kvflow.entrypoints.responses_background import (
    BackgroundRuns,
    EventLog,
    ended_response,
    failed_response,
)
from kvflow.entrypoints.responses_store import ResponseStore, StoredResponse


def stored(response_id: str, status: str = "completed") -> StoredResponse:
    return StoredResponse(ResponseObject(id=response_id, created_at=0, status=status,
                                         model="m", background=True), [])


def test_store_never_drops_a_held_response():
    store = ResponseStore(capacity=3)
    store.hold(stored("a", "queued"))
    store.hold(stored("b", "queued"))
    for name in "cdef":
        store.put(stored(name))
    # a and b are held; of c..f only the newest fits
    assert [r for r in "abcdef" if store.peek(r) is not None] == ["a", "b", "f"]
    assert store.can_hold()
    store.hold(stored("g", "queued"))
    assert not store.can_hold() and store.num_held == 3
    with pytest.raises(ValueError, match="3 background responses run already"):
        store.hold(stored("h", "queued"))
    assert [r for r in "abcdefg" if store.peek(r) is not None] == ["a", "b", "g"]
    store.release("a")
    store.put(stored("i"))  # a is the least recently used idle one now
    assert [r for r in "abgi" if store.peek(r) is not None] == ["b", "g", "i"]
    store.release("nothing")  # no-op


def event(n: int) -> dict:
    return {"type": "x", "sequence_number": n}


def test_event_log_replays_then_follows():
    async def main():
        log = EventLog()
        for n in range(3):
            log.append(event(n))
        got = []

        async def reader(after):
            return [e["sequence_number"] async for e in log.follow(after)]

        tasks = [asyncio.create_task(reader(after)) for after in (-1, 1, 5)]
        await asyncio.sleep(0)
        log.append(event(3))
        await asyncio.sleep(0)
        log.append(event(4))
        log.close()
        got = await asyncio.gather(*tasks)
        with pytest.raises(ValueError, match="out of order"):
            log.append(event(5))  # closed
        return got

    assert asyncio.run(main()) == [[0, 1, 2, 3, 4], [2, 3, 4], []]


def test_event_log_refuses_a_gap():
    async def main():
        log = EventLog()
        log.append(event(0))
        with pytest.raises(ValueError, match="event 2 out of order"):
            log.append(event(2))

    asyncio.run(main())


def test_background_runs_cancel_and_shutdown_end_each_run_once():
    async def main():
        ended, aborted = [], []
        runs = BackgroundRuns(lambda rid, task: ended.append((rid, task.cancelled())))
        forever = asyncio.Event()
        runs.start("a", forever.wait(), lambda: aborted.append("a"))
        runs.start("b", forever.wait(), lambda: aborted.append("b"))
        runs.start("c", asyncio.sleep(0), lambda: aborted.append("c"))
        await runs.cancel("a")  # before it first ran
        assert runs.running("b") and not runs.running("a")
        await asyncio.sleep(0.01)  # c ends by itself
        await runs.shutdown()
        await runs.cancel("b")  # no-op
        return ended, aborted, len(runs)

    ended, aborted, left = asyncio.run(main())
    assert sorted(ended) == [("a", True), ("b", True), ("c", False)]
    assert aborted.count("a") >= 1 and aborted.count("b") >= 1 and "c" in aborted
    assert left == 0


def test_ended_and_failed_responses():
    async def main():
        async def boom():
            raise EngineDeadError("core died")

        async def refused():
            raise RequestRefused("busy", retry_after_s=1.0)

        tasks = [asyncio.create_task(c()) for c in (boom, refused)]
        await asyncio.wait(tasks)
        cancelled = asyncio.create_task(asyncio.sleep(10))
        cancelled.cancel()
        await asyncio.wait([cancelled])
        return tasks + [cancelled]

    dead, busy, cancelled = asyncio.run(main())
    running = stored("r", "in_progress").response
    assert ended_response(running, cancelled).status == "cancelled"
    assert ended_response(running, cancelled).output == []
    items = [{"type": "reasoning", "status": "completed", "content": []},
             {"type": "message", "status": "in_progress",
              "content": [{"type": "output_text", "text": "Hel"}]}]
    kept = ended_response(running, cancelled, items)
    assert [(i["type"], i["status"]) for i in kept.output] == \
        [("reasoning", "completed"), ("message", "incomplete")]  # the open item was cut
    assert kept.output[1]["content"][0]["text"] == "Hel"
    assert items[1]["status"] == "in_progress"  # the run's own items are left alone
    assert ended_response(running, dead, items).output == []  # only a cancel keeps them
    assert ended_response(running, dead).error == {"code": "server_error",
                                                   "message": "core died"}
    assert ended_response(running, busy).error["code"] == "rate_limit_exceeded"
    assert ended_response(stored("r").response, cancelled) is None  # completed stays
    bad = failed_response(running, RequestRefused("grammar did not compile"))
    assert (bad.status, bad.error["code"]) == ("failed", "invalid_prompt")
