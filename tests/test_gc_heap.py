"""kvflow's own processes freeze their start-up heap out of the cyclic garbage collector's reach
(kvflow/runtime/gc_heap.py): what freezing does, and who freezes (the engine-core process, workers of
multi-process executors, the API server) and who does not (the offline LLM's process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CYCLES = textwrap.dedent("""
    import gc, weakref

    class Node:
        pass

    def cycle():  # a reference cycle: only the cyclic collector frees it
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a
""")

SEMANTICS = CYCLES + textwrap.dedent("""
    from kvflow.runtime.gc_heap import freeze_startup_heap, unfreeze_heap

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


IMPORT_FREEZE = CYCLES + textwrap.dedent("""
    from kvflow.runtime.gc_heap import freeze_import_heap, freeze_startup_heap

    keep = [cycle()]                      # an import's object: alive, frozen
    young = weakref.ref(cycle())          # young garbage: collected, not frozen
    frozen = freeze_import_heap()
    assert young() is None, "young garbage was frozen"
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is keep for o in gc.get_objects()), "an import's object left tracked"
    later = [cycle()]                     # what loading the model makes
    tracked = len(gc.get_objects())
    assert tracked < frozen / 10, (tracked, frozen)  # all the later full collection walks
    assert freeze_startup_heap("test") > frozen
    assert not any(o is later for o in gc.get_objects())
    print("ok")
""")


def test_the_import_freeze_leaves_the_later_collection_only_what_came_after():
    """freeze_import_heap freezes what is alive (the imports), not young garbage, so the
    full collection of freeze_startup_heap walks only the objects made after it. Oracle:
    weak references and gc.get_objects (what a full collection walks), in a fresh
    interpreter."""
    done = subprocess.run([sys.executable, "-c", IMPORT_FREEZE], check=False,
                          capture_output=True, text=True, timeout=120)
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
    monkeypatch.setattr(core_proc, "freeze_import_heap", lambda: events.append("imports"))
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
        got = []
        while results.poll(5000):  # the heartbeat thread's socket may deliver first
            got.append(msgspec.msgpack.decode(results.recv()))
            if got[-1].get("type") != "heartbeat":
                break
        assert got and got[-1] == {"ready": 0}, got
    finally:
        results.close(linger=0)
        ctx.term()
    assert events == ["imports", "engine built", "engine core", "ready", "loop", "shutdown"]


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


def test_worker_freeze_returns_the_frozen_count(monkeypatch):
    """Worker.freeze_startup_heap freezes its process and returns gc.get_freeze_count() as
    ``gc.freeze`` left it (in this process; handed back at the end). The oracle is the count
    read right after the real ``gc.freeze``, recorded as it is returned: a frozen object freed
    later (a wrapper's own frame, the log line's handlers) lowers the live count, so a count
    read anywhere else was off by a few objects now and then (2 in CI rehearsals of sessions
    41 and 45)."""
    import gc

    from kvflow.runtime import gc_heap
    from kvflow.worker.worker import Worker

    calls, real_freeze, real_count = [], gc.freeze, gc.get_freeze_count

    def freeze() -> None:
        calls.append("freeze")
        real_freeze()

    def get_freeze_count() -> int:
        calls.append(count := real_count())
        return count

    monkeypatch.setattr(gc_heap.gc, "freeze", freeze)
    monkeypatch.setattr(gc_heap.gc, "get_freeze_count", get_freeze_count)
    w = Worker.__new__(Worker)
    w.rank = 1
    try:
        n = w.freeze_startup_heap()
        assert calls[-2:] == ["freeze", n] and n > 1000, (n, calls)
    finally:
        monkeypatch.undo()
        gc_heap.unfreeze_heap()
    assert gc.get_freeze_count() == 0


FROZEN_CALL = textwrap.dedent("""
    import gc, sys
    from kvflow.runtime.gc_heap import caller_heap_frozen

    gc.disable()                  # a model load: 500,000 tracked objects made since the
    startup = [[i] for i in range(500_000)]  # process's last full collection
    gc.enable()
    walked = []                   # objects tracked when each full collection starts

    def watch(phase, info):
        if phase == "start" and info["generation"] == 2:
            walked.append(sum(len(gc.get_objects(generation=g)) for g in range(3)))

    gc.callbacks.append(watch)
    if sys.argv[1] == "frozen":
        with caller_heap_frozen() as froze:
            steps = [[i] for i in range(100_000)]   # a first run's new survivors
        assert froze and gc.get_freeze_count() == 0
    else:
        steps = [[i] for i in range(100_000)]
    print(max(walked, default=0))
""")


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14's incremental collector "
                    "has no oldest-generation threshold")
def test_a_frozen_call_never_walks_the_startup_heap():
    """Oracle: CPython's rule for collecting the oldest generation (Modules/gcmodule.c: once
    the objects promoted since its last collection exceed a quarter of its survivors) and
    gc.freeze's documented effect, observed with gc.callbacks in fresh interpreters: after a
    500,000-object load, the first 100,000 new survivors meet a full collection that walks
    all 600,000; inside caller_heap_frozen the collections walk only the new objects."""
    walked = {}
    for mode in ("plain", "frozen"):
        done = subprocess.run([sys.executable, "-c", FROZEN_CALL, mode], check=False,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        walked[mode] = int(done.stdout.strip())
    assert walked["plain"] >= 500_000 and walked["frozen"] < 200_000, walked


def test_offline_calls_freeze_the_caller_heap_only_while_stepping(monkeypatch, tiny_llama):
    """LLM._run (generate, chat, embed, ...) steps the engine with the caller's heap frozen
    and unfrozen again afterwards, also when a step raises; a caller's own freeze is kept."""
    import gc

    from kvflow import LLM, SamplingParams

    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=32)
    seen: list[int] = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: seen.append(gc.get_freeze_count()) or step())
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 3
        assert len(seen) == 3 and min(seen) > 1000, seen
        assert gc.get_freeze_count() == 0
        monkeypatch.setattr(llm.engine, "step", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            llm.generate([[5, 6, 7]], params)
        assert gc.get_freeze_count() == 0
        gc.freeze()  # the caller's own: left as it is
        mine = gc.get_freeze_count()
        monkeypatch.setattr(llm.engine, "step", lambda: seen.append(gc.get_freeze_count()) or
                            step())
        seen.clear()
        llm.generate([[5, 6, 7]], params)
        # neither unfrozen (0) nor frozen again (more objects: the request's): as it was,
        # less what refcounting freed
        assert len(seen) == 3 and 0 < min(seen) and max(seen) <= mine, (seen, mine)
        assert 0 < gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()
        llm.shutdown()


EARLY = textwrap.dedent("""
    import gc
    from kvflow.entrypoints.api_server import freeze_after

    seen = []
    freeze_after(seen.append)("tokenizer")   # the server's template check, then the freeze
    assert seen == ["tokenizer"] and gc.get_freeze_count() > 0
    gc.unfreeze()

    def broken(tokenizer):
        raise ValueError("bad template")

    try:
        freeze_after(broken)("tokenizer")
    except ValueError as e:
        assert str(e) == "bad template"
    assert gc.get_freeze_count() == 0, "froze although the check failed"
    freeze_after(None)(None)                 # --chat-template given: no check, still frozen
    assert gc.get_freeze_count() > 0
    print("ok")
""")


def test_the_api_server_freezes_its_heap_once_the_tokenizer_is_loaded():
    """run_server's ``on_tokenizer`` (``freeze_after``): while the core still loads the model,
    the API process collects and freezes its heap (torch, transformers, the tokenizer,
    FastAPI), so the freeze before serving only walks what was made since (was: the whole
    heap, 0.6-0.8 s on 2 busy cores, between the engine's ready and /health). In a fresh
    interpreter, whose heap the test may freeze."""
    done = subprocess.run([sys.executable, "-c", EARLY], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
