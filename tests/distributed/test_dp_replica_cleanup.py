"""An offline ``LLM(model, data_parallel_size=2)`` dropped without ``shutdown()`` stops its
replicas' engine-core processes, as vLLM's LLM does (its core client's finalizer) and as
kvflow's multiprocess executor stops its tensor-parallel workers. Oracle: psutil, for the pids
of the core processes read before the LLM is dropped.

The replicas of a SIGKILLed script (a new interpreter and two core processes: the slowest
case) run in scripts/test_distributed_slow.sh; the default run kills such a script's
tensor-parallel workers (tests/distributed/test_worker_orphans.py, the same clean-up check)."""

from __future__ import annotations

import gc
import textwrap
import time

import psutil

from kvflow import LLM, SamplingParams
from tests.distributed.conftest import slow
from tests.distributed.test_worker_orphans import kill_script_and_check_cleanup


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


@slow
def test_replicas_of_a_killed_process_exit_and_remove_its_folder(tiny_llama, tmp_path):
    """A script (main guard: its cores come from the forkserver) whose ``LLM`` has two
    replicas is SIGKILLed (SIGTERM's default action is the same: no clean-up): both core
    processes exit (they poll for their parent) and the script's ``kvflow-dp-*`` folder, whose
    sockets the cores used, is gone with them (was: left in the temporary directory)."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from kvflow import LLM
        if __name__ == "__main__":
            llm = LLM(model={tiny_llama.path!r}, dtype="float32", num_kv_blocks=64,
                      data_parallel_size=2)
            print(*[core.pid for core in llm.engine.core.cores], flush=True)
            time.sleep(600)
    """))
    kill_script_and_check_cleanup(script, tmp_path, "kvflow-dp-*")
