"""The grammar compile pool and the manager's time limit, without a model: compiles are
plain functions that block on events, the clock a fake one, so every case is exact and
takes milliseconds."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

from kvflow.structured import StructuredOutputsParams
from kvflow.structured.compile_pool import CompilePool, CompileTimeoutError
from kvflow.structured.manager import StructuredOutputManager


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def test_stuck_compile_is_abandoned_and_frees_its_slot():
    """One thread: a compile stuck past the limit fails with CompileTimeoutError at
    ``expire`` and the queued compile runs in its slot while the stuck one still runs."""
    clock, release = FakeClock(), threading.Event()
    pool = CompilePool(num_threads=1, timeout_s=2.0, clock=clock)
    slow = pool.submit(lambda: release.wait(10) and "slow")
    fast = pool.submit(lambda x: x * 3, 7)
    time.sleep(0.05)
    assert not fast.done() and not slow.done()  # queued behind the one thread
    clock.now += 1.9
    assert pool.expire() == 0 and not slow.done()
    clock.now += 0.2  # 2.1 s since the slow one started
    assert pool.expire() == 1
    with pytest.raises(CompileTimeoutError):
        slow.result(timeout=0)
    assert fast.result(timeout=5) == 21  # ran while the abandoned compile still runs
    assert pool.num_abandoned == 1
    release.set()
    _wait_until(lambda: pool.num_abandoned == 0)
    assert pool.expire() == 0


def test_at_most_num_threads_run_and_results_pass_through():
    clock, release, started = FakeClock(), threading.Event(), []
    pool = CompilePool(num_threads=2, timeout_s=5.0, clock=clock)

    def job(i: int) -> int:
        started.append(i)
        release.wait(10)
        if i == 2:
            raise ValueError("bad grammar 2")
        return i * 10

    futures = [pool.submit(job, i) for i in range(3)]
    _wait_until(lambda: len(started) == 2)
    time.sleep(0.05)
    assert sorted(started) == [0, 1]  # the third waits for a slot
    assert pool.next_deadline() == pytest.approx(105.0)
    release.set()
    assert [f.result(timeout=5) for f in futures[:2]] == [0, 10]
    with pytest.raises(ValueError, match="bad grammar 2"):
        futures[2].result(timeout=5)
    assert pool.next_deadline() is None


def test_abandoned_compiles_hold_their_threads_until_they_end():
    """One compile counted as running, at most two threads alive: two stuck compiles are
    abandoned in turn; then the pool is saturated and a third compile does not start until
    a stuck one ends by itself."""
    clock, releases = FakeClock(), [threading.Event(), threading.Event()]
    pool = CompilePool(num_threads=1, timeout_s=2.0, max_threads=2, clock=clock)
    stuck = [pool.submit(lambda e=e: e.wait(10) and "stuck") for e in releases]
    started = []
    fast = pool.submit(lambda: started.append(1) or "fast")
    clock.now += 2.1
    assert pool.expire() == 1 and not pool.is_saturated  # the second stuck one starts
    clock.now += 2.1
    assert pool.expire() == 1 and pool.num_abandoned == 2 and pool.is_saturated
    time.sleep(0.05)
    assert started == [] and not fast.done()  # two threads live: none may start
    for future in stuck:
        with pytest.raises(CompileTimeoutError):
            future.result(timeout=0)
    releases[0].set()
    assert fast.result(timeout=5) == "fast"
    assert pool.num_abandoned == 1 and not pool.is_saturated
    releases[1].set()
    _wait_until(lambda: pool.num_abandoned == 0)


EXIT_WHILE_COMPILING = """
import random, sys, threading, time, xgrammar as xgr
from kvflow.structured.compile_pool import CompilePool
rng = random.Random(0)
vocab = ["".join(rng.choices('abcdefghij"\\\\ {}[]:,0123', k=rng.randint(1, 12)))
         for _ in range(20000)]
compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab), max_threads=1, cache_enabled=False)
pool = CompilePool(1, 0.05)
pool.submit(compiler.compile_grammar, 'root ::= [^"\\\\\\\\] | root{2,8}')  # ~1 s of C++
if sys.argv[1] == "abandoned":
    time.sleep(0.1)
    print("abandoned", pool.expire())  # its thread compiles on


class SlowTeardown:  # freed while the interpreter finalizes: waits there for the compile
    def __del__(self, threads=threading.active_count, sleep=time.sleep, clock=time.monotonic):
        deadline = clock() + 20
        while threads() > 1 and clock() < deadline:
            sleep(0.05)


teardown = SlowTeardown()
print("exiting")
"""


def test_the_interpreter_exits_cleanly_while_a_grammar_compiles():
    """A process that exits while xgrammar compiles (an ``LLM`` script whose last request's
    grammar timed out, its compile abandoned, or one ended meanwhile) exits with status 0:
    the exit waits for every compile thread, an abandoned one too (it cannot be stopped).
    Was: the compile thread, back from C++ while the interpreter finalized, was ended there:
    ``terminate called without an active exception``, status 134. The script's teardown
    waits for the compile, so the old code failed every time (and an exit that waited only
    the compile timeout, for the abandoned one)."""
    runs = [subprocess.Popen([sys.executable, "-c", EXIT_WHILE_COMPILING, state], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for state in ("running", "abandoned")]
    results = [(p.wait(timeout=120), *p.communicate()) for p in runs]
    assert [(rc, out) for rc, out, _ in results] == [
        (0, "exiting\n"), (0, "abandoned 1\nexiting\n")], results


def test_pool_refuses_a_cap_below_its_threads():
    with pytest.raises(ValueError, match="max_threads=1 is below num_threads=2"):
        CompilePool(num_threads=2, timeout_s=1.0, max_threads=1)


class BlockingBackend:
    """Compiles a grammar to its text; the grammar ``"slow"`` blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []

    def compile(self, params: StructuredOutputsParams) -> str:
        self.calls.append(params.grammar)
        if params.grammar == "slow":
            self.release.wait(10)
        if params.grammar == "broken":
            raise RuntimeError("xgrammar said no")
        if params.grammar == "refused":
            raise ValueError("the constraint is too costly to compile")
        return params.grammar

    def new_matcher(self, compiled: str) -> str:
        return AnyTokenMatcher(f"matcher({compiled})")


class AnyTokenMatcher(str):
    """A fake matcher (its text names it) whose first step allows every token."""

    def fill_bitmask(self, bitmask, row) -> None:
        bitmask[row].fill_(-1)


def _ready(manager: StructuredOutputManager, state) -> bool:
    """Whether ``state`` is ready once the manager's per-step check ran (``take_failed``
    checks a compiled grammar's first step before the request may be scheduled)."""
    manager.take_failed()
    return state.is_ready


def _take_failed_within(manager: StructuredOutputManager, timeout_s: float) -> list:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        failed = manager.take_failed()
        if failed:
            return failed
        manager.wait_for_compiles(0.05)
    return []


def test_manager_fails_timed_out_requests_and_refuses_identical_ones_at_once():
    backend = BlockingBackend()
    manager = StructuredOutputManager(lambda: backend, vocab_size=64, max_num_seqs=4,
                                      compile_timeout_s=0.3, num_compile_threads=1)
    slow = StructuredOutputsParams(grammar="slow")
    state = manager.request_state(slow, "r0")
    fast = manager.request_state(StructuredOutputsParams(grammar="fast"), "r1")
    began = time.monotonic()
    failed = _take_failed_within(manager, 5.0)
    assert time.monotonic() - began >= 0.25  # not before the limit (0.3 s from its start)
    assert [rid for rid, _ in failed] == ["r0"]
    assert "did not compile within 0.3 s" in failed[0][1]
    assert "--structured-output-compile-timeout" in failed[0][1]
    assert not state.is_ready and state.matcher is None  # never scheduled
    _wait_until(lambda: _ready(manager, fast))  # the one thread was freed for it
    assert fast.matcher == "matcher(fast)"
    again = manager.request_state(slow, "r2")  # refused at once, no second compile
    assert not again.is_ready and manager.take_failed()[0][0] == "r2"
    assert backend.calls.count("slow") == 1
    backend.release.set()
    manager.shutdown()


def test_manager_reports_compile_errors_and_retries_them():
    backend = BlockingBackend()
    manager = StructuredOutputManager(lambda: backend, vocab_size=64, max_num_seqs=4,
                                      compile_timeout_s=5.0)
    broken = StructuredOutputsParams(grammar="broken")
    manager.request_state(broken, "a")
    failed = _take_failed_within(manager, 5.0)
    assert failed == [("a", "structured_outputs could not be compiled: xgrammar said no")]
    manager.request_state(broken, "b")
    assert _take_failed_within(manager, 5.0)[0][0] == "b"
    assert backend.calls == ["broken", "broken"]  # an error is retried, not cached
    ok = manager.request_state(StructuredOutputsParams(grammar="ok"), "c")
    _wait_until(lambda: _ready(manager, ok))
    assert manager.take_failed() == [] and ok.matcher == "matcher(ok)"


def test_manager_logs_a_refused_constraint_without_a_traceback(caplog):
    """A ValueError from the backend is its refusal of the client's constraint (the count
    budget of xgrammar_backend): the request fails with its message alone, and the core logs
    no ERROR traceback for it (bad input, not a server fault); any other compile error still
    logs one."""
    backend = BlockingBackend()
    manager = StructuredOutputManager(lambda: backend, vocab_size=64, max_num_seqs=4,
                                      compile_timeout_s=5.0)
    with caplog.at_level("WARNING", logger="kvflow.structured.manager"):
        manager.request_state(StructuredOutputsParams(grammar="refused"), "a")
        assert _take_failed_within(manager, 5.0) == [
            ("a", "the constraint is too costly to compile")]
        assert [r for r in caplog.records if r.levelname == "ERROR"] == []
        manager.request_state(StructuredOutputsParams(grammar="broken"), "b")
        assert _take_failed_within(manager, 5.0)[0][0] == "b"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == ["structured output: compiling grammar failed"]
    assert errors[0].exc_info[0] is RuntimeError
    manager.shutdown()


def test_manager_is_busy_while_timed_out_compiles_fill_every_thread():
    """max_compile_threads=1: once the slow compile is abandoned, a grammar that needs a new
    compile is refused (``busy_message``) while a cached one is not; when the slow compile
    ends, new grammars compile again."""
    backend = BlockingBackend()
    manager = StructuredOutputManager(lambda: backend, vocab_size=64, max_num_seqs=4,
                                      compile_timeout_s=0.2, num_compile_threads=1,
                                      max_compile_threads=1)
    fast, slow = StructuredOutputsParams(grammar="fast"), StructuredOutputsParams(grammar="slow")
    assert manager.busy_message(fast) is None  # no pool yet
    done = manager.request_state(fast, "r0")
    _wait_until(lambda: _ready(manager, done))
    manager.request_state(slow, "r1")
    assert [rid for rid, _ in _take_failed_within(manager, 5.0)] == ["r1"]
    other = StructuredOutputsParams(grammar="other")
    message = manager.busy_message(other)
    assert message == ("the server is busy compiling structured-output grammars: 1 compiles "
                       "that passed the 0.2 s limit (--structured-output-compile-timeout) "
                       "still run, the most it allows (--structured-output-max-compile-threads"
                       " 1); retry later")
    assert manager.busy_message(fast) is None  # compiled: needs no thread
    assert manager.busy_message(slow) is None  # refused by its own timeout instead
    backend.release.set()
    _wait_until(lambda: manager.busy_message(other) is None)
    state = manager.request_state(other, "r2")
    _wait_until(lambda: _ready(manager, state))
    assert state.matcher == "matcher(other)"
    manager.shutdown()


class FirstTokenBackend(BlockingBackend):
    """Compiles grammar ``"t<i>,<j>"`` to a matcher whose first step allows tokens i and j."""

    def new_matcher(self, compiled: str):
        class Matcher:
            def fill_bitmask(self, bitmask, row):
                bitmask[row].zero_()
                for t in map(int, filter(None, compiled[1:].split(","))):
                    bitmask[row, t // 32] |= 1 << (t % 32)

        return Matcher()


def test_first_steps_are_checked_before_scheduling():
    """A constrained request is not ready (not schedulable) until ``take_failed`` checked
    its grammar's first step: refused when its allowed_token_ids miss every first token
    (33 and 70 allowed first, 34 and 69 by the request; neighbours in the same bitmask
    words), or when the grammar allows no first token at all (it matches no text); ready
    when they share a token (70), or without allowed ids."""
    manager = StructuredOutputManager(FirstTokenBackend, vocab_size=100, max_num_seqs=4,
                                      compile_timeout_s=5.0)
    grammar = StructuredOutputsParams(grammar="t33,70")
    plain = manager.request_state(grammar, "plain")
    disjoint = manager.request_state(grammar, "disjoint", [34, 69])
    shared = manager.request_state(grammar, "shared", [5, 70])
    empty = manager.request_state(StructuredOutputsParams(grammar="t"), "empty")
    _wait_until(lambda: plain.is_compiled and empty.is_compiled)
    assert not plain.is_ready and not disjoint.is_ready and not shared.is_ready
    failed = manager.take_failed()
    message = ("SamplingParams.allowed_token_ids allows none of the tokens the grammar can "
               "start with: no output could satisfy both; allow a token that can begin the "
               "grammar's text")
    empty_message = ("the grammar matches no text: no token can begin it (every first token "
                     "is masked, so the request would end with no output)")
    assert sorted(failed) == [("disjoint", message), ("empty", empty_message)]
    assert plain.is_ready and shared.is_ready and not disjoint.is_ready and not empty.is_ready
    again = manager.request_state(grammar, "cached", [70])  # compiled: checked next call
    assert not again.is_ready and manager.take_failed() == [] and again.is_ready
    manager.shutdown()


@pytest.mark.parametrize("kwargs, needle", [
    ({"structured_output_compile_timeout": 0}, "structured_output_compile_timeout=0 must"),
    ({"structured_output_compile_timeout": -1.5}, "compile_timeout=-1.5 must"),
    ({"structured_output_compile_timeout": float("inf")},
     "compile_timeout=inf must be a finite number of seconds > 0"),
    ({"structured_output_compile_timeout": float("nan")},
     "compile_timeout=nan must be a finite number of seconds > 0"),
    ({"structured_output_compile_threads": 0}, "structured_output_compile_threads=0 must"),
    ({"structured_output_compile_threads": 3, "structured_output_max_compile_threads": 2},
     "structured_output_max_compile_threads=2 must be >= structured_output_compile_threads=3"),
])
def test_config_refuses_bad_limits(kwargs, needle):
    from kvflow.config import EngineConfig

    with pytest.raises(ValueError, match=re.escape(needle)):
        EngineConfig.from_kwargs(**kwargs)


def test_cli_flags_set_the_limits():
    import argparse

    from kvflow.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--structured-output-compile-timeout", "2.5",
                              "--structured-output-compile-threads", "3",
                              "--structured-output-max-compile-threads", "5"])
    so = EngineConfig.from_cli_args(args).structured_output_config
    assert (so.structured_output_compile_timeout, so.structured_output_compile_threads,
            so.structured_output_max_compile_threads) == (2.5, 3, 5)
    default = EngineConfig.from_cli_args(parser.parse_args([])).structured_output_config
    assert (default.structured_output_compile_timeout,
            default.structured_output_compile_threads,
            default.structured_output_max_compile_threads) == (30.0, 2, None)
    assert CompilePool(2, 1.0).max_threads == 4  # None: twice the compile threads
