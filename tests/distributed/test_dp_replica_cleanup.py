"""An offline ``LLM(model, data_parallel_size=2)`` dropped without ``shutdown()`` stops its
replicas' engine-core processes, as vLLM's LLM does (its core client's finalizer) and as
kvflow's multiprocess executor stops its tensor-parallel workers. Oracle: psutil, for the pids
of the core processes read before the LLM is dropped."""

from __future__ import annotations

import gc
import time

import psutil

from kvflow import LLM, SamplingParams


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_dropped_data_parallel_llm_stops_its_replicas(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64, data_parallel_size=2)
    pids = [core.pid for core in llm.engine.core.cores]
    out = llm.generate("the quick", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert len(set(pids)) == 2 and all(_running(pid) for pid in pids)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert set(pids) <= children
    del llm, out
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    try:
        assert [pid for pid in pids if _running(pid)] == []  # was: both ran until exit
    finally:
        for pid in pids:
            if _running(pid):
                psutil.Process(pid).kill()
