"""KV cache events across an engine-core restart (``kvflow serve --engine-failure restart``:
``AsyncLLM.restart``), received by a ZeroMQ SUB socket as tests/test_kv_events.py does.

Was: the new core published its blocks from sequence 0 with no ``AllBlocksCleared``, so a
KV-aware router kept the dead core's blocks (routing prompts to a cache that no longer held
them). Now the new core's first batch begins with ``AllBlocksCleared``, followed by its own
``BlockStored`` (the same hashes, computed by hand as tests/test_kv_events.py's ``chain``);
its sequence numbers start at 0 again (the dead core's last one died with it), the
``AllBlocksCleared`` marking the restart. A first start publishes no ``AllBlocksCleared``.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import zmq
from transformers import AutoTokenizer

from kvflow.core.kv_events import AllBlocksCleared, decode_kv_event_batch
from tests.e2e.conftest import free_port
from tests.test_kv_events import (
    BLOCK_SIZE,
    NUM_KV_BLOCKS,
    ONE_TOKEN,
    PROMPTS,
    Subscriber,
    chain,
    stored_blocks,
)


async def _before_and_after_a_restart(engine, sub: Subscriber, ids: list[int]):
    """The batches received for one prompt before the core is killed, and for the same
    prompt once a new core serves: ``(seq, [decoded events])`` each."""
    from kvflow.engine.async_llm import collect

    await engine.start()
    try:
        dead = asyncio.Event()
        engine.on_dead = lambda error: dead.set()
        await asyncio.wait_for(collect(engine.add_request("a", None, ids, ONE_TOKEN)), 60)
        before = sub.drain()
        os.kill(engine.core_pid, signal.SIGKILL)
        await asyncio.wait_for(dead.wait(), 30)
        await engine.restart(120)
        for _ in range(20):  # a router's SUB, reading: its socket reconnects to the new
            assert not sub.sock.poll(50)  # core (libzmq subscribes on the new connection
        # when the socket is next used; the new core sends nothing before its first step)
        await asyncio.wait_for(collect(engine.add_request("b", None, ids, ONE_TOKEN)), 60)
        after = sub.drain()
    finally:
        await engine.shutdown()
    return ([(seq, decode_kv_event_batch(p).events) for seq, p in before],
            [(seq, decode_kv_event_batch(p).events) for seq, p in after])


@pytest.mark.timeout(300)
def test_a_restarted_core_first_clears_the_dead_cores_blocks(tiny_llama, tmp_path):
    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM

    port = free_port()  # TCP, as a router subscribes: it reconnects to the new core
    engine = AsyncLLM(EngineConfig.from_kwargs(
        model=tiny_llama.path, dtype="float32", block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=True,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}))
    ids = AutoTokenizer.from_pretrained(tiny_llama.path)(PROMPTS[0])["input_ids"]
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, f"tcp://127.0.0.1:{port}")
        before, after = asyncio.run(_before_and_after_a_restart(engine, sub, ids))
    finally:
        engine.close()
        sub.sock.close(linger=0)
        ctx.term()
    expected = {h: (parent, block) for h, parent, block in chain(ids)}
    assert [seq for seq, _ in before] == list(range(len(before)))
    first = [e for _, events in before for e in events]
    assert not any(isinstance(e, AllBlocksCleared) for e in first)  # a first start: nothing
    assert stored_blocks(first) == expected
    # the new core: from sequence 0 again, its first batch led by AllBlocksCleared
    assert [seq for seq, _ in after] == list(range(len(after)))
    assert isinstance(after[0][1][0], AllBlocksCleared)  # was: BlockStored
    assert stored_blocks([e for _, events in after for e in events]) == expected
