"""kvflow's own processes freeze their start-up heap out of the cyclic garbage collector's reach
(kvflow/gc_heap.py): what freezing does, and who freezes (the engine-core process, workers of
multi-process executors, the API server) and who does not (the offline LLM's process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SEMANTICS = textwrap.dedent("""
    import gc, weakref
    from kvflow.gc_heap import freeze_startup_heap, unfreeze_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    keep = [cycle()]                      # alive at start-up, garbage later
    old = weakref.ref(keep[0])
    frozen = freeze_startup_heap("test")
    assert frozen == gc.get_freeze_count() > 0, frozen
    assert not any(o is keep for o in gc.get_objects()), "a start-up object left tracked"

    new = weakref.ref(cycle())            # garbage made after the freeze: still collected
    gc.collect()
    assert new() is None, "a cycle made after the freeze was not collected"

    keep.clear()                          # start-up garbage stays while frozen...
    gc.collect()
    assert old() is not None, "a frozen object was collected"
    unfreeze_heap()                       # ...and goes once handed back
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None, "an unfrozen cycle was not collected"
    print("ok")
""")


def test_freezing_hides_the_startup_heap_and_later_garbage_is_still_collected():
    """Oracle: CPython's documented gc.freeze semantics, observed through weak references to
    reference cycles made before and after the freeze (run in a fresh interpreter, whose heap
    the test may freeze)."""
    done = subprocess.run([sys.executable, "-c", SEMANTICS], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_engine_core_process_freezes_after_building_the_engine_and_before_ready(
        monkeypatch, tmp_path):
    """run_engine_core: EngineCore built (model loaded), then the heap frozen, then ready
    sent, then the loop: a request can never meet the start-up collection. Faked: the
    engine, the loop and the freeze (recorded in order); the ZMQ sockets are real."""
    import msgspec
    import zmq

    from kvflow.config import EngineConfig
    from kvflow.engine import core_proc

    events: list = []

    class FakeCore:
        def __init__(self, config):
            events.append("engine built")

        def shutdown(self):
            events.append("shutdown")

    class FakeLoop:
        def __init__(self, core, inp, out, index):
            pass

        def run(self):
            events.append("loop")

    monkeypatch.setattr(core_proc, "EngineCore", FakeCore)
    monkeypatch.setattr(core_proc, "EngineCoreProc", FakeLoop)
    monkeypatch.setattr(core_proc, "freeze_startup_heap", lambda name: events.append(name))
    monkeypatch.setattr(core_proc, "_ready", lambda core, index: events.append("ready") or
                        {"ready": index})
    monkeypatch.setattr(core_proc.signal, "signal", lambda *a: None)  # keep pytest's handlers
    ctx = zmq.Context()
    results = ctx.socket(zmq.PULL)
    out_addr = f"ipc://{tmp_path}/out"
    results.bind(out_addr)
    try:
        core_proc.run_engine_core(EngineConfig(), f"ipc://{tmp_path}/in", out_addr)
        assert results.poll(5000)
        assert msgspec.msgpack.decode(results.recv()) == {"ready": 0}
    finally:
        results.close(linger=0)
        ctx.term()
    assert events == ["engine built", "engine core", "ready", "loop", "shutdown"]


def test_multiprocess_executors_ask_each_worker_to_freeze_and_uniproc_does_not(monkeypatch):
    """Executor.freeze_worker_heaps is one collective call of Worker.freeze_startup_heap
    (multi-process and Ray executors); the uniproc executor's worker lives in the caller's
    process, whose collector it leaves alone."""
    import gc

    from kvflow.executor.multiproc import MultiprocExecutor
    from kvflow.executor.ray import RayExecutor
    from kvflow.executor.uniproc import UniprocExecutor
    from kvflow.worker.worker import Worker

    calls: list = []
    for cls in (MultiprocExecutor, RayExecutor):
        monkeypatch.setattr(cls, "collective_rpc",
                            lambda self, method, *a: calls.append((type(self), method)))
        cls.__new__(cls).freeze_worker_heaps()
    assert calls == [(MultiprocExecutor, "freeze_startup_heap"),
                     (RayExecutor, "freeze_startup_heap")]
    assert callable(Worker.freeze_startup_heap)
    uniproc = UniprocExecutor.__new__(UniprocExecutor)
    before = gc.get_freeze_count()
    uniproc.freeze_worker_heaps()
    assert gc.get_freeze_count() == before == 0


def test_the_engine_asks_its_executor_once_set_up(monkeypatch, tiny_llama):
    """EngineCore's construction ends with executor.freeze_worker_heaps (after the KV cache,
    graphs and scheduler are set up); the offline LLM's own process stays unfrozen."""
    import gc

    from kvflow import LLM
    from kvflow.executor.uniproc import UniprocExecutor

    calls: list = []
    original = UniprocExecutor.freeze_worker_heaps
    monkeypatch.setattr(UniprocExecutor, "freeze_worker_heaps",
                        lambda self: calls.append(self.worker.runner is not None) or
                        original(self))
    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=32)
    try:
        assert calls == [True]
        assert gc.get_freeze_count() == 0
    finally:
        llm.shutdown()


def test_worker_freeze_returns_the_frozen_count():
    """Worker.freeze_startup_heap freezes its process and returns gc.get_freeze_count() (in
    this process; handed back at the end)."""
    import gc

    from kvflow.gc_heap import unfreeze_heap
    from kvflow.worker.worker import Worker

    w = Worker.__new__(Worker)
    w.rank = 1
    try:
        n = w.freeze_startup_heap()
        assert n == gc.get_freeze_count() > 1000, n
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
