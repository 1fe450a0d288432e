"""Engine-core liveness seen from ``AsyncLLM`` (the server's engine): a core process stopped
with SIGSTOP (alive, silent) or killed with SIGKILL, with one replica and with two.

Was (frozen core): nothing noticed it: its streams waited for ever, ``is_healthy`` (the
server's /health) stayed true and the balancer kept sending it requests. Now a live core
silent for ``engine_heartbeat_timeout`` seconds (2 here) is killed and lost like a dead one:
its open requests raise ``EngineDeadError`` naming it, a data-parallel sibling serves on and
takes the new requests, and with no replica left ``is_healthy`` is false. Every lost replica
is counted in ``kvflow:engine_cores_lost`` by reason.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kvflow import SamplingParams
from kvflow.config import EngineConfig
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, collect
from kvflow.engine.core_client import ReplicaState

TIMEOUT_S = 2.0
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
IDS = [5, 6, 7, 8, 9, 10, 11, 12]


def _engine(model: str, dp: int) -> AsyncLLM:
    return AsyncLLM(EngineConfig.from_kwargs(
        model=model, dtype="float32", num_kv_blocks=96, data_parallel_size=dp,
        engine_heartbeat_timeout=TIMEOUT_S))


def _lost(engine: AsyncLLM, index: int, reason: str) -> float:
    return engine.metrics.registry.get_sample_value(
        "kvflow:engine_cores_lost_total",
        {"model_name": engine.config.model_config.model, "engine": str(index),
         "reason": reason}) or 0.0


async def _first_token(stream) -> None:
    async for _ in stream:
        return


async def _stream_until_error(stream) -> BaseException:
    with pytest.raises(EngineDeadError) as info:
        async for _ in stream:
            pass
    return info.value


@pytest.fixture(scope="module")
def dp_engine(tiny_llama):
    engine = _engine(tiny_llama.path, 2)
    yield engine
    asyncio.run(engine.shutdown())


async def _freeze_replica_one(engine: AsyncLLM):
    await engine.start()
    on_zero = engine.add_request("a", None, IDS, LONG, data_parallel_rank=0)
    on_one = engine.add_request("b", None, IDS, LONG, data_parallel_rank=1)
    await asyncio.wait_for(asyncio.gather(_first_token(on_zero), _first_token(on_one)), 30)
    os.kill(engine.cores[1].pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    error = await asyncio.wait_for(_stream_until_error(on_one), 3 * TIMEOUT_S + 5)
    waited = time.monotonic() - frozen_at
    engine.abort("a")
    after = await asyncio.wait_for(collect(engine.add_request("c", None, IDS, SHORT)), 30)
    return error, waited, after


def test_a_frozen_replica_fails_its_requests_and_its_sibling_serves(dp_engine):
    error, waited, after = asyncio.run(_freeze_replica_one(dp_engine))
    assert "engine core 1 of 2" in str(error) and "sent no heartbeat and used no CPU for" in str(error)
    assert "the process is stopped (SIGSTOP or SIGTSTP)" in str(error)
    assert TIMEOUT_S - 0.5 <= waited < TIMEOUT_S + 3, waited  # since its last beat: 0.5 s apart
    assert len(after.outputs[0].token_ids) == 4  # served by replica 0
    assert [c.state for c in dp_engine.cores] == [ReplicaState.LIVE, ReplicaState.DEAD]
    assert dp_engine.is_healthy
    assert _lost(dp_engine, 1, "unresponsive") == 1.0 and _lost(dp_engine, 0, "unresponsive") == 0
    deadline = time.monotonic() + 5  # killed: a frozen core would hold its device
    while dp_engine.cores[1].is_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not dp_engine.cores[1].is_alive and dp_engine.cores[1].proc.exitcode == -signal.SIGKILL


@pytest.fixture(scope="module")
def one_engine(tiny_llama):
    engine = _engine(tiny_llama.path, 1)
    yield engine
    asyncio.run(engine.shutdown())


async def _lose_the_core(engine: AsyncLLM, sig: int):
    """Stream, send ``sig`` to the core after the first token; returns the stream's error,
    the seconds it took, what ``on_dead`` got and whether the engine was healthy then; then
    restarts the core (as ``kvflow serve --engine-failure restart``) and checks it serves."""
    await engine.start()
    dead = []
    engine.on_dead = dead.append
    stream = engine.add_request(f"long-{sig}", None, IDS, LONG)
    await asyncio.wait_for(_first_token(stream), 30)
    os.kill(engine.core_pid, sig)
    start = time.monotonic()
    error = await asyncio.wait_for(_stream_until_error(stream), 3 * TIMEOUT_S + 5)
    waited, healthy = time.monotonic() - start, engine.is_healthy
    with pytest.raises(EngineDeadError):  # no replica left: refused (the server's 503)
        engine.add_request(f"refused-{sig}", None, IDS, SHORT)
    await engine.restart(60)
    after = await asyncio.wait_for(collect(engine.add_request(f"after-{sig}", None, IDS,
                                                              SHORT)), 30)
    assert len(after.outputs[0].token_ids) == 4
    return error, waited, dead, healthy


def test_a_frozen_single_core_is_dead_within_the_timeout(one_engine):
    error, waited, dead, healthy = asyncio.run(_lose_the_core(one_engine, signal.SIGSTOP))
    assert str(error).startswith("engine core (pid ") and "sent no heartbeat and used no CPU for" in str(error)
    assert str(error).endswith("(engine_heartbeat_timeout=2): the process is stopped "
                               "(SIGSTOP or SIGTSTP); killed it")
    assert TIMEOUT_S - 0.5 <= waited < TIMEOUT_S + 3, waited  # since its last beat: 0.5 s apart
    assert not healthy and dead == [error]
    assert _lost(one_engine, 0, "unresponsive") == 1.0


def test_a_killed_single_core_is_dead_at_once(one_engine):
    error, waited, dead, healthy = asyncio.run(_lose_the_core(one_engine, signal.SIGKILL))
    assert str(error) == "engine core process exited with code -9"
    assert waited < 2.5, waited  # the exit is polled every second, not timed out
    assert not healthy and dead == [error]
    assert _lost(one_engine, 0, "exited") == 1.0


async def _freeze_the_restart(engine: AsyncLLM):
    """Kill the core, restart it (``--engine-failure restart``) and stop the new process
    before it is ready; returns the restart's error, the seconds it took after the stop and
    the new core."""
    await engine.start()
    os.kill(engine.core_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.cores[0].state is not ReplicaState.DEAD and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    restart = asyncio.create_task(engine.restart(30))
    await asyncio.sleep(0)  # the restart ran up to its wait: the new process is started
    new = engine.cores[0]
    os.kill(new.pid, signal.SIGSTOP)  # still importing or loading: not ready
    stopped_at = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        await asyncio.wait_for(restart, 60)
    return str(info.value), time.monotonic() - stopped_at, new


def test_a_restarted_core_frozen_before_ready_fails_the_restart_within_the_timeout(one_engine):
    """Was: the output loop judged live replicas only, so a restarting core stopped before
    its ``EngineReady`` was waited for until the restart's timeout (``--engine-start-timeout``,
    600 s; 30 s here)."""
    lost = _lost(one_engine, 0, "unresponsive")
    message, waited, new = asyncio.run(_freeze_the_restart(one_engine))
    assert waited < TIMEOUT_S + 3, waited  # was: 30 s
    assert message.startswith(f"engine core failed to restart: engine core (pid {new.pid}) "
                              "sent no heartbeat and used no CPU for ")
    assert message.endswith(" s while starting (engine_heartbeat_timeout=2): the process is "
                            "stopped (SIGSTOP or SIGTSTP); killed it")
    deadline = time.monotonic() + 5
    while new.is_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not new.is_alive and new.proc.exitcode == -signal.SIGKILL
    assert new.state is ReplicaState.DEAD and not one_engine.is_healthy
    assert _lost(one_engine, 0, "unresponsive") == lost  # a failed restart is not a loss
