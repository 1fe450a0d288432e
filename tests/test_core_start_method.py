"""How engine-core processes start (kvflow/engine/start_method.py): forked by ``kvflow serve``
and ``run-batch`` run as their own process, from Python's forkserver everywhere else on Linux
(spawned where the forkserver started with another environment, off Linux, where the process
can no longer fork safely, or as ``KVFLOW_WORKER_MULTIPROC_METHOD`` says). The server side (a
forked first core, a spawned restart, the variable's ``spawn``) is checked on real processes
in tests/e2e/test_engine_faults.py; a forkserver core serving requests, below."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import types
from multiprocessing import forkserver as mp_forkserver
from types import SimpleNamespace

import pytest
import torch

from kvflow.engine import forkserver_start, start_method
from kvflow.engine.forkserver_start import (
    PRELOAD,
    ParentState,
    current_environment,
    forkserver_pid,
    forkserver_usable,
    import_time_differences,
    process_environment,
)
from kvflow.engine.start_method import START_METHOD_VARIABLE, core_start_method, method_now


@pytest.mark.parametrize(("value", "fresh", "expected"), [
    (None, True, "fork"), (None, False, "forkserver"), ("", True, "fork"),
    ("", False, "forkserver"), ("auto", True, "fork"), ("auto", False, "forkserver"),
    ("spawn", True, "spawn"), ("spawn", False, "spawn"),
    ("fork", True, "fork"), ("fork", False, "fork"),
    ("forkserver", True, "forkserver"), ("forkserver", False, "forkserver"),
])
def test_the_variable_and_a_fresh_process_pick_the_method(monkeypatch, value, fresh, expected):
    if value is None:
        monkeypatch.delenv(START_METHOD_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(START_METHOD_VARIABLE, value)
    assert core_start_method(fresh) == expected


@pytest.mark.parametrize("value", ["fork", "forkserver", "auto"])
def test_off_linux_cores_are_spawned(monkeypatch, value):
    monkeypatch.setenv(START_METHOD_VARIABLE, value)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert core_start_method(True) == core_start_method(False) == "spawn"


BAD_VALUE_MESSAGE = ("KVFLOW_WORKER_MULTIPROC_METHOD='threads' is invalid; choose one of "
                     "['auto', 'fork', 'forkserver', 'spawn']")


def test_a_bad_value_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(START_METHOD_VARIABLE, "threads")
    for fresh in (True, False):
        with pytest.raises(ValueError) as err:
            core_start_method(fresh)
        assert str(err.value) == BAD_VALUE_MESSAGE


def test_an_in_process_engine_refuses_a_bad_value_before_starting_a_core(monkeypatch,
                                                                        tiny_llama):
    """``AsyncLLM`` and the offline ``LLM``'s replicas read the variable when their
    ``ReplicaSet`` is made: the same one error, and no core process started."""
    from kvflow.config import EngineConfig
    from kvflow.engine import replica_set
    from kvflow.engine.async_llm import AsyncLLM

    started = []
    monkeypatch.setattr(replica_set.CoreProcess, "start", lambda *a, **k: started.append(a))
    monkeypatch.setenv(START_METHOD_VARIABLE, "threads")
    with pytest.raises(ValueError) as err:
        AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32"))
    assert str(err.value) == BAD_VALUE_MESSAGE and started == []


def test_an_offline_llm_without_replicas_refuses_a_bad_value_too(monkeypatch, tiny_llama):
    """One process, no core process to start: the variable is still read (a typo is not
    ignored in one mode and refused in another), with the same message, before any load."""
    from kvflow import LLM
    from kvflow.engine import llm_engine

    loads = []
    monkeypatch.setattr(llm_engine, "resolve_model", lambda *a: loads.append(a))
    monkeypatch.setenv(START_METHOD_VARIABLE, "threads")
    with pytest.raises(ValueError) as err:
        LLM(model=tiny_llama.path, dtype="float32")
    assert str(err.value) == BAD_VALUE_MESSAGE and loads == []


@pytest.mark.parametrize(("method", "exitcode", "file", "spec", "hinted"), [
    ("forkserver", 1, "/home/u/dp.py", None, True), ("spawn", 1, "/home/u/dp.py", None, True),
    ("fork", 1, "/home/u/dp.py", None, False),  # a forked child runs no top level again
    ("forkserver", -9, "/home/u/dp.py", None, False),  # killed: not the guard
    ("forkserver", 1, None, None, False),  # a notebook or python -c: nothing to run again
    ("forkserver", 1, "/x/pkg/__main__.py", "pkg.__main__", False),  # -m: multiprocessing skips
])
def test_a_core_exiting_at_start_names_the_main_guard_only_where_it_can_be_the_cause(
        monkeypatch, method, exitcode, file, spec, hinted):
    """The RuntimeError of a core that exited while starting ends with a hint about the
    ``__main__`` guard exactly when the core re-ran a script's top level and exited with 1."""
    import types

    from kvflow.engine.core_client import main_guard_hint

    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = file, spec
    monkeypatch.setitem(sys.modules, "__main__", main)
    core = SimpleNamespace(method=method, proc=SimpleNamespace(exitcode=exitcode))
    hint = main_guard_hint(core)
    assert (hint == " (it ran dp.py's top level again, as a spawned or forkserver process does: "
            "a script that starts engine processes needs that code under `if __name__ == "
            "\"__main__\":`; README, \"Several processes\")") if hinted else hint == ""


@pytest.mark.parametrize(("first", "restart"), [
    ("fork", "spawn"), ("forkserver", "forkserver"), ("spawn", "spawn")])
def test_a_restarted_replica_starts_as_the_first_one_but_never_forks(monkeypatch, first,
                                                                      restart):
    """``ReplicaSet.respawn`` (``--engine-failure restart``) on a set whose cores started with
    ``first``; the method its new ``CoreProcess`` is started with is recorded (no process)."""
    from kvflow.config import EngineConfig
    from kvflow.engine import replica_set

    assert start_method.restart_method(first) == restart
    _quiet_process(monkeypatch)
    monkeypatch.setattr(start_method, "forkserver_usable", lambda: True)
    methods = []
    monkeypatch.setattr(replica_set.CoreProcess, "start",
                        lambda self, log_level, go=None, method="spawn": methods.append(method))
    replicas = replica_set.ReplicaSet(EngineConfig(), start_method=first)
    try:
        replicas.start()
        replicas.respawn(0)
    finally:
        replicas.close()
    assert methods == [first, restart]


def _quiet_process(monkeypatch) -> None:
    """This (pytest) process as a fresh ``kvflow serve`` sees it: one Python thread, no CUDA,
    no Ray."""
    monkeypatch.setattr(start_method.threading, "active_count", lambda: 1)
    monkeypatch.delitem(sys.modules, "ray", raising=False)


def test_fork_stays_fork_in_a_quiet_process(monkeypatch):
    _quiet_process(monkeypatch)
    assert method_now("fork") == "fork"
    assert method_now("spawn") == "spawn"


def test_a_running_thread_makes_it_spawn(monkeypatch):
    _quiet_process(monkeypatch)
    monkeypatch.undo()  # the real thread count, with one more thread running for sure
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert threading.active_count() >= 2
        assert method_now("fork") == "spawn"
    finally:
        release.set()
        thread.join()


def test_cuda_initialised_makes_it_spawn(monkeypatch):
    import torch

    _quiet_process(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert method_now("fork") == "spawn"


def test_ray_started_makes_it_spawn(monkeypatch):
    _quiet_process(monkeypatch)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    assert method_now("fork") == "spawn"
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    assert method_now("fork") == "fork"


def test_the_cli_refuses_a_bad_value_before_the_model_loads(tiny_chat_model):
    """One ``kvflow: error`` line and exit 2; no engine process is started (a model load
    would print the core's log lines)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", tiny_chat_model,
         "--host", "127.0.0.1", "--port", str(port)], check=False, capture_output=True,
        text=True, timeout=120, env={**os.environ, START_METHOD_VARIABLE: "threads"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"kvflow: error: {BAD_VALUE_MESSAGE}"]


# ---- the forkserver ---------------------------------------------------------------------------
def _forkserver_running() -> int:
    """This process's forkserver, started as an engine core starts it (kvflow's preload) unless
    it runs already; returns its pid once it has exec'd (``ensure_running`` returns as soon as
    it forked; /proc/<pid>/environ read while it execs is empty)."""
    if forkserver_pid() is None:
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    mp_forkserver.ensure_running()
    pid = forkserver_pid()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (b"multiprocessing.forkserver" not in _cmdline(pid)
                                           or process_environment(pid) is None):
        time.sleep(0.01)
    return pid


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_process_environment_is_read_from_proc():
    env = {"PATH": os.environ["PATH"], "KVFLOW_PROBE": "a b=c", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(["sleep", "30"], env=env)
    try:
        # (Popen returns microseconds before the kernel has put the environment in place)
        read = [process_environment(proc.pid) for _ in range(1000)]
        assert next(e for e in read if e is not None) == env  # the oracle: what exec was given
    finally:
        proc.kill()
        proc.wait()
    assert process_environment(proc.pid) is None  # gone (reaped)


def test_the_current_environment_is_what_a_new_process_gets(monkeypatch):
    """A variable set by a library through the C library only (GNU readline sets ``COLUMNS``
    and ``LINES`` so): ``os.environ`` misses it, a new process has it, and so does
    :func:`current_environment`."""
    import ctypes

    libc = ctypes.CDLL(None)
    monkeypatch.setenv("KVFLOW_PROBE", "through os.environ")
    assert libc.setenv(b"COLUMNS_PROBE", b"set by C", 1) == 0
    try:
        code = "import json, os; print(json.dumps(dict(os.environ)))"
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True, timeout=60)
        now = current_environment()
    finally:
        libc.unsetenv(b"COLUMNS_PROBE")
    assert "COLUMNS_PROBE" not in os.environ
    assert now == json.loads(child.stdout)  # the oracle: what exec passed on
    assert now["COLUMNS_PROBE"] == "set by C" and now["KVFLOW_PROBE"] == "through os.environ"
    assert "COLUMNS_PROBE" not in current_environment()


def test_only_variables_read_at_import_count():
    a = {"KVFLOW_CPU_GEMM": "native", "PYTEST_CURRENT_TEST": "x", "OMP_NUM_THREADS": "2"}
    assert import_time_differences(a, {**a, "KVFLOW_CPU_GEMM": "onednn",
                                       "PYTEST_CURRENT_TEST": "y", "KVFLOW_NEW": "1"}) == []
    # set by libraries imported later (GNU readline; scikit-learn, under sentence-transformers)
    assert import_time_differences(a, {**a, "COLUMNS": "80", "LINES": "24",
                                       "KMP_DUPLICATE_LIB_OK": "True",
                                       "KMP_INIT_AT_FORK": "FALSE"}) == []
    assert import_time_differences(a, {**a, "OMP_NUM_THREADS": "3", "HF_HOME": "/h"}) == [
        "HF_HOME", "OMP_NUM_THREADS"]  # a changed one, and one set on one side only


def test_the_forkserver_is_used_unless_its_start_environment_differs(monkeypatch, caplog):
    """A difference in an import-time variable is said at INFO, naming the variable (why this
    core starts slower)."""
    pid = _forkserver_running()
    started = process_environment(pid)
    assert started is not None and "PATH" in started
    assert forkserver_usable({**started, "KVFLOW_CPU_GEMM": "onednn", "PYTEST_X": "1"})
    with caplog.at_level(logging.INFO, logger="kvflow.engine.forkserver_start"):
        assert not forkserver_usable({**started, "MALLOC_ARENA_MAX": "2"})
    said = ("engine core spawned (a new interpreter, its imports again), not forked from the "
            "forkserver: MALLOC_ARENA_MAX changed since the forkserver started (read at import)")
    assert [r.getMessage() for r in caplog.records] == [said]
    assert not forkserver_usable({k: v for k, v in started.items() if k != "PATH"})
    monkeypatch.setattr(forkserver_start, "forkserver_pid", lambda: None)
    assert forkserver_usable({"MALLOC_ARENA_MAX": "2"})  # none runs yet: it starts with these
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(forkserver_start, "forkserver_pid", lambda: gone.pid)
    assert not forkserver_usable(started)  # its environment cannot be read: spawn


def test_method_now_spawns_where_the_forkserver_cannot_serve(monkeypatch):
    monkeypatch.setattr(start_method, "forkserver_usable", lambda: True)
    assert method_now("forkserver") == "forkserver"
    monkeypatch.setattr(start_method, "forkserver_usable", lambda: False)
    assert method_now("forkserver") == "spawn"


_CHILD = """
parent.apply()
import json, os, sys
print("printed by the child", flush=True)
with open(path, "w") as f:
    json.dump({"ppid": os.getppid(), "cwd": os.getcwd(), "path_entry": entry in sys.path,
               **{name: os.environ.get(name) for name in names}}, f)
"""


def test_a_forkserver_child_gets_the_parent_environment_and_output_of_now(monkeypatch,
                                                                          tmp_path):
    """Set after the forkserver started: a ``KVFLOW_*`` variable (set), ``PATH`` (removed),
    fd 1 pointed at a file the forkserver never had, the working directory and a ``sys.path``
    entry (multiprocessing's preparation data); the child sees them all."""
    pid = _forkserver_running()
    assert "PATH" in process_environment(pid)
    monkeypatch.setenv("KVFLOW_PROBE", "set after the forkserver started")
    monkeypatch.delenv("PATH")
    entry = str(tmp_path / "on_sys_path")
    monkeypatch.syspath_prepend(entry)
    monkeypatch.chdir(tmp_path)
    assert os.readlink(f"/proc/{pid}/cwd") != str(tmp_path)
    result, printed = tmp_path / "env.json", tmp_path / "stdout"
    ctx = multiprocessing.get_context("forkserver")
    saved = os.dup(1)
    try:
        with open(printed, "w") as out:
            os.dup2(out.fileno(), 1)
        child = ctx.Process(target=exec, args=(_CHILD, {
            "parent": ParentState(current_environment()), "path": str(result),
            "entry": entry, "names": ["KVFLOW_PROBE", "PATH"]}))
        child.start()
        child.join(60)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert child.exitcode == 0
    assert json.loads(result.read_text()) == {
        "ppid": pid, "PATH": None, "KVFLOW_PROBE": "set after the forkserver started",
        "cwd": str(tmp_path), "path_entry": True}
    assert printed.read_text() == "printed by the child\n"


def test_parent_state_is_pickled_only_to_start_a_process():
    import pickle

    with pytest.raises(TypeError):
        pickle.dumps(ParentState({}))


def test_the_forkserver_preload_computes_nothing():
    """What the forkserver runs before it forks (:data:`PRELOAD`'s imports) in a new
    interpreter: no thread beyond the ones ``import numpy`` starts alone (OpenBLAS's pool,
    which is fork-safe; no OpenMP region ran: libgomp starts its threads at the first one), no
    CUDA, and none of kvflow's per-process caches filled (they read ``KVFLOW_*`` variables,
    which a core must read from its own environment)."""
    code = f"""
import functools, json, os, sys, threading
import numpy
numpy_threads = len(os.listdir("/proc/self/task"))
for name in {list(PRELOAD)!r}:
    __import__(name)
import torch
filled = sorted(f"{{m}}.{{k}}" for m, mod in list(sys.modules.items())
                if m.startswith("kvflow") and mod is not None
                for k, v in list(vars(mod).items())
                if hasattr(v, "cache_info") and getattr(v, "__module__", None) == m
                and v.cache_info().currsize)
print(json.dumps({{"filled": filled, "py": threading.active_count(),
                  "threads": len(os.listdir("/proc/self/task")) - numpy_threads,
                  "cuda": torch.cuda.is_initialized()}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert json.loads(out.stdout.splitlines()[-1]) == {"filled": [], "threads": 0, "py": 1,
                                                        "cuda": False}


def _environment_of_the_forkserver(monkeypatch) -> None:
    """This process's environment made the forkserver's start environment where a variable
    read at import differs (an earlier test may have started it under another one), so that
    the engine below is forked from it."""
    started = process_environment(_forkserver_running())
    for name in import_time_differences(current_environment(), started):
        if name in started:
            monkeypatch.setenv(name, started[name])
        else:  # (setenv first: one set behind os.environ's back, readline's COLUMNS, say)
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)
    assert forkserver_usable()


async def _greedy(engine, ids: list[int], n: int) -> list[int]:
    from kvflow import SamplingParams
    from kvflow.engine.async_llm import collect

    await engine.start()
    try:
        out = await collect(engine.add_request(
            "r", None, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    finally:
        await engine.shutdown()
    return list(out.outputs[0].token_ids)


def test_a_core_forked_from_the_forkserver_serves_hf_greedy_tokens(tiny_llama, monkeypatch):
    """An in-process ``AsyncLLM`` (as in a test or a notebook) starts its core from the
    forkserver by default: the core's parent is the forkserver, and it serves transformers'
    greedy tokens."""
    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM

    monkeypatch.delenv(START_METHOD_VARIABLE, raising=False)
    _environment_of_the_forkserver(monkeypatch)
    ids = [1, 5, 9, 13, 17, 21]
    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=32))
    try:
        assert engine.replicas.start_method == "forkserver"
        assert _ppid(engine.replicas.cores[0].pid) == forkserver_pid() != os.getpid()
        tokens = asyncio.run(_greedy(engine, ids, 8))
    finally:
        engine.close()
    hf = tiny_llama.hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
    assert tokens == hf[0, len(ids):].tolist()


def test_a_forkserver_core_reads_kvflow_variables_set_after_the_forkserver_started(
        tiny_llama, monkeypatch, capfd):
    """``KVFLOW_CPU_GEMM`` set to a bad value after the forkserver started (and after the
    config was checked in this process): the core reads it from the parent's environment of
    now, refuses it (the one error ``AsyncLLM`` raises) and logs that to this process's
    standard error (the ``[core]`` tag is the core's log format)."""
    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM

    monkeypatch.delenv(START_METHOD_VARIABLE, raising=False)
    _environment_of_the_forkserver(monkeypatch)
    config = EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32", num_kv_blocks=32)
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "bogus")
    logging.getLogger("kvflow").setLevel(logging.DEBUG)  # the core's too (restored by conftest)
    with pytest.raises(ValueError) as err:
        AsyncLLM(config)
    message = "KVFLOW_CPU_GEMM='bogus' is invalid; choose one of ['auto', 'native', 'onednn']"
    assert str(err.value) == message
    assert f"[core]: engine core: {message}" in capfd.readouterr().err
