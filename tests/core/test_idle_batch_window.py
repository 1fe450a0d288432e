"""``idle_batch_window_ms``: an idle engine's first step waits (on the scheduler's clock) for a
burst to arrive, bounded by the window; a busy engine never waits.

No model: a fake KV config and a fake clock (tests/core/sim.py). ``drive`` plays the engine
core's loop (``kvflow/engine/core_proc.py``): add what has arrived, wait while
``batch_wait_s`` says so (until the next arrival or the window's end), else step; a step
takes ``step_s`` on the clock. Oracles: the step compositions computed by hand below.
"""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from kvflow.config import EngineConfig, SchedulerConfig
from kvflow.engine import core_proc
from kvflow.engine.core_proc import EngineCoreProc
from kvflow.engine.messages import Shutdown
from kvflow.offline.llm import LLM
from kvflow.request import RequestStatus
from kvflow.runner_output import ModelRunnerOutput
from tests.core.sim import FakeClock, SimRequest, assert_idle, make_sim_scheduler, to_request

PROMPT = 128
BUDGET = 2048  # 16 prompts of 128 tokens


def burst(n: int, gap_s: float = 0.001) -> list[SimRequest]:
    """``n`` requests of ``PROMPT`` tokens -> 2, one every ``gap_s`` from t = 0."""
    return [SimRequest(f"r{i}", i * gap_s, PROMPT, 2) for i in range(n)]


def drive(workload: list[SimRequest], window_ms: float, step_s: float = 0.2,
          **config) -> tuple[list[tuple[float, dict[str, int]]], object]:
    """Run ``workload`` to the end; returns each step's (start time, tokens per request)."""
    clock = FakeClock()
    sched = make_sim_scheduler(clock, max_num_batched_tokens=BUDGET,
                               idle_batch_window_ms=window_ms, **config)
    pending, steps = sorted(workload, key=lambda r: r.arrival), []
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival <= clock.now + 1e-12:
            sched.add_request(to_request(pending.pop(0)))
        if not sched.has_unfinished_requests():
            clock.now = pending[0].arrival
            continue
        wait_s = sched.batch_wait_s()
        assert 0.0 <= wait_s <= window_ms / 1e3
        if wait_s > 0:  # the core polls its input until a message comes or the wait ends
            clock.now = min(clock.now + wait_s, pending[0].arrival) if pending \
                else clock.now + wait_s
            continue
        out = sched.schedule()
        steps.append((clock.now, dict(out.num_scheduled_tokens)))
        clock.now += step_s
        runner = ModelRunnerOutput()
        for rid in out.num_scheduled_tokens:
            request = sched.requests[rid]
            if request.num_computed_tokens == request.num_tokens:
                runner.req_ids.append(rid)
                runner.sampled_token_ids.append([100 + request.num_tokens % 900])
        sched.update_from_output(out, runner)
    assert_idle(sched)
    return steps, sched


def test_burst_fills_the_first_step():
    """20 prompts of 128 tokens, one a millisecond, window 50 ms: the first step waits until
    r0-r15 fill the 2,048-token budget (r15 arrives at 15 ms) and takes all 16; the second
    decodes r0-r15 (16 tokens) and prefills r16-r19 (4 x 128)."""
    steps, _ = drive(burst(20), window_ms=50)
    start, first = steps[0]
    assert start == pytest.approx(0.015)
    assert first == {f"r{i}": PROMPT for i in range(16)}
    assert steps[1][1] == {**{f"r{i}": 1 for i in range(16)},
                           **{f"r{i}": PROMPT for i in range(16, 20)}}


def test_without_window_the_first_step_takes_one_request():
    """The same burst, window 0 (the default): step 1 at t = 0 holds r0 alone; during its
    0.2 s the rest arrive, so step 2 decodes r0 (1 token), prefills r1-r15 (15 x 128 =
    1,920) and the first 2,048 - 1 - 1,920 = 127 tokens of r16."""
    steps, _ = drive(burst(20), window_ms=0)
    assert steps[0] == (0.0, {"r0": PROMPT})
    assert steps[1][1] == {"r0": 1, **{f"r{i}": PROMPT for i in range(1, 16)}, "r16": 127}


@pytest.mark.parametrize("window_ms", [0, 5, 30])
def test_lone_request_waits_the_window_at_most(window_ms):
    """A lone request's first step starts exactly ``window_ms`` after its arrival (the
    waiting prompt never fills the budget); its second step follows at once."""
    steps, _ = drive([SimRequest("solo", 0.0, PROMPT, 2)], window_ms=window_ms)
    assert [s[0] for s in steps] == pytest.approx([window_ms / 1e3, window_ms / 1e3 + 0.2])
    assert steps[0][1] == {"solo": PROMPT}


def test_window_counts_from_the_first_arrival():
    """r0 at 0, r1 at 20 ms, window 30 ms: r1's arrival does not reopen the window; the first
    step starts at 30 ms with both. Once it runs, a new arrival (r2 at 40 ms, during the
    step) is not waited for."""
    workload = [SimRequest("r0", 0.0, PROMPT, 3), SimRequest("r1", 0.02, PROMPT, 3),
                SimRequest("r2", 0.04, PROMPT, 3)]
    steps, _ = drive(workload, window_ms=30)
    assert steps[0] == (pytest.approx(0.03), {"r0": PROMPT, "r1": PROMPT})
    assert steps[1] == (pytest.approx(0.23), {"r0": 1, "r1": 1, "r2": PROMPT})


def test_max_num_seqs_ends_the_wait():
    """max_num_seqs 4: the wait ends when the 4th request arrives (3 ms), though 512 prompt
    tokens leave the budget far from full."""
    steps, _ = drive(burst(6), window_ms=50, max_num_seqs=4)
    assert steps[0] == (pytest.approx(0.003), {f"r{i}": PROMPT for i in range(4)})


def test_a_busy_engine_never_waits():
    """With a request running, a new arrival's wait is 0 whatever the window."""
    clock = FakeClock()
    sched = make_sim_scheduler(clock, idle_batch_window_ms=100)
    sched.add_request(to_request(SimRequest("a", 0.0, PROMPT, 4)))
    assert sched.batch_wait_s() == pytest.approx(0.1)
    clock.now = 0.1
    sched.schedule()  # "a" runs; its step is in flight
    sched.add_request(to_request(SimRequest("b", 0.1, PROMPT, 4)))
    assert sched.batch_wait_s() == 0.0
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert_idle(sched)


@pytest.mark.parametrize("bad", [-1.0, 1000.5, float("nan")])
def test_bad_window_is_refused(bad):
    with pytest.raises(ValueError, match="idle_batch_window_ms"):
        SchedulerConfig(idle_batch_window_ms=bad)


def test_offline_llm_refuses_the_window():
    """A server option: LLM queues every prompt before its first step (refused before any
    model is loaded)."""
    with pytest.raises(ValueError, match="idle_batch_window_ms=5 is a server option"):
        LLM("no-such-model", idle_batch_window_ms=5)


def test_offline_llm_refuses_the_window_from_an_engine_config():
    config = EngineConfig.from_kwargs(model="unused", idle_batch_window_ms=5)
    with pytest.raises(ValueError, match="idle_batch_window_ms=5 is a server option"):
        LLM.from_engine_config(config)


def test_engine_core_loop_polls_its_input_for_the_wait_then_steps():
    """The engine-core process's loop: while ``batch_wait_s`` is open it polls its input
    for the wait's milliseconds (rounded up) instead of stepping, then steps; then, with
    nothing left, it blocks for input and reads the Shutdown."""
    inp = SimpleNamespace(polls=[], messages=[])
    inp.poll = lambda ms: inp.polls.append(ms) or bool(inp.messages)
    inp.recv = lambda: inp.messages.pop(0)
    waits, events = [0.0121, 0.0], []

    def step():
        events.append("step")
        inp.messages.append(msgspec.msgpack.encode(Shutdown()))
        return []
    core = SimpleNamespace(
        config=EngineConfig(), step=step,
        has_unfinished_requests=lambda: "step" not in events,
        scheduler=SimpleNamespace(batch_wait_s=lambda: waits.pop(0)))
    EngineCoreProc(core, inp, SimpleNamespace(send=events.append)).run()
    assert events == ["step"]
    assert inp.polls == [0, 13, 0, core_proc._IDLE_POLL_MS, 0]


def test_busy_engine_core_loop_ends_when_the_api_process_dies(monkeypatch):
    """A busy core checks its API process between steps (every ``_PARENT_CHECK_S``): once it
    is gone the loop ends with requests unfinished. It had been checked only while the core
    was idle, so a core whose API process was killed generated on for its requests, to
    nobody, until they all finished (measured: 10-15 s for one 200-token request on a CPU)."""
    monkeypatch.setattr(core_proc, "_PARENT_CHECK_S", 0.0, raising=False)  # every step
    inp = SimpleNamespace(poll=lambda ms: False)
    steps = []

    def step():
        steps.append("step")
        if len(steps) > 10:
            raise AssertionError("the core stepped on after its API process died")
        return []
    core = SimpleNamespace(config=EngineConfig(), step=step,
                           has_unfinished_requests=lambda: True,  # never finishes
                           scheduler=SimpleNamespace(batch_wait_s=lambda: 0.0))
    loop = EngineCoreProc(core, inp, SimpleNamespace(send=lambda payload: None))
    alive = iter([True, True, False, False])
    loop._parent = SimpleNamespace(is_alive=lambda: next(alive))
    loop.run()  # returns: before, it stepped on (forever here)
    assert steps == ["step"] * 2  # checked before each step: alive, alive, gone
