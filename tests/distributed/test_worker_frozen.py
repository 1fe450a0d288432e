"""A tensor-parallel worker process stopped with SIGSTOP (alive, silent: no exit status, its
peer waits in a collective) under ``AsyncLLM`` (the server's engine; ``mp`` executor, TP=2,
``worker_heartbeat_timeout=2``): found by its missing heartbeats within the timeout (plus a
check period), mid-stream and while the engine is idle; the stream ends with an
``EngineDeadError`` naming the rank, its pid and "the process is stopped (SIGSTOP or
SIGTSTP)", the stopped worker is killed, and a restart (``--engine-failure restart``) serves
again (after the mid-stream case; the idle case runs last and leaves the engine failed). A
step that runs longer than the timeout (rank 1 computing for 2 timeouts) is not taken for
frozen.

Was (idle): never found while the timeout was under about 2 s: the idle core checked its
workers once a second, and the heartbeat monitor forgives every check that comes more than
half a timeout after the previous one (the engine itself did not run), so each check reset
the silence. Oracles: ``/proc`` (the workers' pids and states), the same request's tokens
on the same engine without the slow step, the clock.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kvflow import SamplingParams
from kvflow.config import EngineConfig
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, collect
from kvflow.logits_process import AdapterLogitsProcessor

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux /proc")

TIMEOUT_S = 2.0
HERE = "tests.distributed.test_worker_frozen"
IDS = [5, 6, 7, 8, 9, 10, 11, 12]
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def _short(**extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                          extra_args=extra or None)


class SlowOnRankOne(AdapterLogitsProcessor):
    """Per request with ``extra_args={"busy_s": s}``: on rank 1 only, its first token's
    step computes (matrix products, the process running) for ``s`` seconds first."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        busy_s = (params.extra_args or {}).get("busy_s")
        if busy_s is None or not (dist.is_initialized() and dist.get_rank() == 1):
            return None

        def busy(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            if not output_ids:
                a, end = torch.rand(128, 128), time.monotonic() + busy_s
                while time.monotonic() < end:
                    a = torch.tanh(a @ a)
            return row
        return busy


def _workers(core_pid: int) -> list[int]:
    """The pids of the core's worker processes, by rank (from their command lines:
    ``-m kvflow.executor.mp_worker <args> <rank> <fd>``)."""
    ranks = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == core_pid and b"kvflow.executor.mp_worker" in argv:
            ranks[int(argv[argv.index(b"kvflow.executor.mp_worker") + 2])] = int(proc.name)
    return [ranks[r] for r in sorted(ranks)]


def _state(pid: int) -> str | None:
    """The process's state letter, None once it is gone (or a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state == "Z" else state


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _state(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return _state(pid) is None


@pytest.fixture(scope="module")
def tp_engine(tiny_llama):
    engine = AsyncLLM(EngineConfig.from_kwargs(
        model=tiny_llama.path, dtype="float32", num_kv_blocks=96, tensor_parallel_size=2,
        worker_heartbeat_timeout=TIMEOUT_S, logits_processors=[f"{HERE}:SlowOnRankOne"]))
    yield engine
    asyncio.run(engine.shutdown())


def _assert_named(error: BaseException, pid: int) -> None:
    message = str(error)
    assert f"worker rank 1 (pid {pid}) sent no heartbeat for " in message, message
    assert "(worker_heartbeat_timeout=2): the process is stopped (SIGSTOP or SIGTSTP)" \
        in message, message


async def _restart_and_serve(engine: AsyncLLM) -> None:
    await engine.restart(120)
    out = await asyncio.wait_for(collect(engine.add_request(
        f"after-{time.monotonic()}", None, IDS, _short())), 60)
    assert len(out.outputs[0].token_ids) == 4


async def _long_step(engine: AsyncLLM):
    await engine.start()
    workers = _workers(engine.core_pid)
    plain = await asyncio.wait_for(collect(engine.add_request("plain", None, IDS, _short())),
                                   60)
    start = time.monotonic()
    busy = await asyncio.wait_for(collect(engine.add_request(
        "busy", None, IDS, _short(busy_s=2 * TIMEOUT_S))), 60)
    return workers, plain, busy, time.monotonic() - start


def test_a_step_longer_than_the_timeout_is_not_taken_for_frozen(tp_engine):
    workers, plain, busy, took = asyncio.run(_long_step(tp_engine))
    assert took >= 2 * TIMEOUT_S  # the step did run that long on rank 1
    assert busy.outputs[0].token_ids == plain.outputs[0].token_ids
    assert tp_engine.is_healthy and _workers(tp_engine.core_pid) == workers


async def _stop_mid_stream(engine: AsyncLLM):
    await engine.start()
    victim = _workers(engine.core_pid)[1]
    stream = engine.add_request("long", None, IDS, LONG)
    async for _ in stream:
        break
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        async for _ in stream:
            pass
    waited, healthy = time.monotonic() - stopped_at, engine.is_healthy
    with pytest.raises(EngineDeadError):  # refused until restarted (the server's 503)
        engine.add_request("refused", None, IDS, _short())
    gone = _gone(victim)
    await _restart_and_serve(engine)
    return victim, info.value, waited, healthy, gone


def test_a_worker_stopped_mid_stream_ends_the_stream_naming_it(tp_engine):
    victim, error, waited, healthy, gone = asyncio.run(
        asyncio.wait_for(_stop_mid_stream(tp_engine), 300))
    _assert_named(error, victim)
    assert TIMEOUT_S - 0.5 <= waited < TIMEOUT_S + 3, waited
    assert not healthy and gone


async def _stop_while_idle(engine: AsyncLLM):
    await engine.start()
    dead: list[BaseException] = []
    engine.on_dead = dead.append
    victim = _workers(engine.core_pid)[1]
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    while not dead and time.monotonic() - stopped_at < 3 * TIMEOUT_S + 5:
        await asyncio.sleep(0.05)
    waited, healthy = time.monotonic() - stopped_at, engine.is_healthy
    gone = _gone(victim)
    if not dead:
        os.kill(victim, signal.SIGKILL)  # leave nothing stopped behind
    return victim, dead, waited, healthy, gone


def test_a_worker_stopped_while_idle_fails_the_engine_naming_it(tp_engine):
    """The module engine's last use: it stays failed (the restart is the mid-stream case's)."""
    victim, dead, waited, healthy, gone = asyncio.run(_stop_while_idle(tp_engine))
    assert len(dead) == 1, f"not found within {waited:.1f} s"
    _assert_named(dead[0], victim)
    assert TIMEOUT_S - 0.5 <= waited < TIMEOUT_S + 3, waited
    assert not healthy and gone  # the stopped worker was killed, not left holding memory


@pytest.mark.parametrize("timeout_s, poll_ms", [(2.0, 500), (30.0, 1000), (0.002, 1)])
def test_an_idle_core_checks_its_workers_four_times_a_timeout(timeout_s, poll_ms):
    """The idle core's wake-up period: a quarter of ``worker_heartbeat_timeout`` (the
    monitor forgives checks more than half a timeout apart), at most 1 s, at least 1 ms;
    1 s for an engine without workers. No process."""
    from kvflow.engine.core_proc import idle_poll_ms
    from kvflow.executor.multiproc import MultiprocExecutor
    from kvflow.executor.uniproc import UniprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._heartbeat_timeout_s = timeout_s
    assert idle_poll_ms(executor) == poll_ms
    assert idle_poll_ms(UniprocExecutor.__new__(UniprocExecutor)) == 1000
    assert idle_poll_ms(None) == 1000
