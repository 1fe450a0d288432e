"""Kernel-test setup: run Triton kernels in the interpreter (CPU) when there is no CUDA.

``TRITON_INTERPRET`` must be set before triton is first imported, so it is set here, at
conftest import time (tests/kernels/triton_setup.py).  Test modules skip themselves if triton
is missing.  The Triton engine tests' runs (tests/kernels/engine_runs.py) start in a worker
process at the first kernel test (``_engine_runs_started``).
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import pytest

from kvflow.kernels import cpu_build, cpu_native
from tests.kernels.engine_runs import RUNS, FusedRun, run_in_child
from tests.kernels.triton_setup import use_interpreter

use_interpreter()


@pytest.fixture(params=[lv.name for lv in cpu_build.isa_levels_for_cpu()])
def kernels(request):
    """kvflow's native CPU kernels built at each ISA level this CPU runs (avx512_bf16, avx512,
    avx2, x86-64 where available), one parameter per level; skipped where one cannot build.
    The per-ISA kernel tests take it as ``kernels`` (a module defining its own wins)."""
    k = cpu_native.native_cpu_kernels_for_isa(request.param)
    if k is None:
        pytest.skip(f"{request.param} kernels could not be built")
    return k


@pytest.fixture(scope="module")
def tiny_llama_path(tiny_llama) -> str:
    """The session's tiny Llama (tests/conftest.py), saved with its tokenizer: engine-level
    kernel tests compare backends on it."""
    return tiny_llama.path


# Every Triton engine run the engine tests ask for, in the order they ask:
# (kind, tiny model, arguments after the model's path)
BACKGROUND_RUNS = [
    ("unfused", "llama", ("torch", "auto")), ("unfused", "llama", ("triton", "auto")),
    ("unfused", "llama", ("torch", "int8")), ("unfused", "llama", ("triton", "int8")),
    ("unfused", "llama", ("torch", "fp8_e4m3")), ("unfused", "llama", ("triton", "fp8_e4m3")),
    ("fused", "llama", ("auto", False)),
    ("unfused", "qwen3", ("triton", "auto")), ("fused", "qwen3", ("auto", True)),
    ("unfused", "gemma3", ("triton", "auto")), ("fused", "gemma3", ("auto", True)),
    ("fused", "llama", ("int8", True)), ("fused", "llama", ("fp8_e4m3", True))]
# The runs of test_fused_kernels_engine.py's cases that carry its SLOW marks: started only in
# the slow run (scripts/test_distributed_slow.sh sets KVFLOW_TEST_DISTRIBUTED_SLOW=1).
SLOW_RUNS = [("unfused", "qwen3", ("triton", "auto")), ("fused", "qwen3", ("auto", True)),
             ("unfused", "gemma3", ("triton", "auto")), ("fused", "gemma3", ("auto", True)),
             ("fused", "llama", ("fp8_e4m3", True))]
BACKGROUND_MODULES = ("test_engine_triton_cpu.py", "test_fused_kernels_engine.py")


@pytest.fixture(scope="session", autouse=True)
def _engine_runs_started(request: pytest.FixtureRequest) -> Iterator[dict[tuple, Future]]:
    """When the session runs the Triton engine tests (``BACKGROUND_MODULES``), start every
    ``BACKGROUND_RUNS`` run (but the ``SLOW_RUNS`` outside the slow run) at the first kernel
    test, in one spawned worker process: the runs (interpreted Triton, several seconds each)
    proceed on the other core while the kernel tests before those modules run. {(kind, path, *args): its Future}; empty when not needed,
    when Triton does not run interpreted here, or under pytest-xdist (every worker sees the
    whole session's items, and the other worker keeps the second core busy)."""
    wanted = any(getattr(item, "path", None) is not None and
                 item.path.name in BACKGROUND_MODULES for item in request.session.items)
    if not wanted or os.environ.get("TRITON_INTERPRET") != "1" or \
            os.environ.get("PYTEST_XDIST_WORKER") or \
            importlib.util.find_spec("triton") is None:
        yield {}
        return
    factory = request.getfixturevalue("tiny_model_factory")
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    futures = {}
    slow = os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") == "1"
    for kind, name, args in BACKGROUND_RUNS:
        if not slow and (kind, name, args) in SLOW_RUNS:
            continue
        key = (kind, factory(name).path, *args)
        futures[key] = pool.submit(run_in_child, *key)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _from_background(futures: dict[tuple, Future], kind: str, *args: Any) -> Any:
    """The worker's result for ``(kind, *args)``; run here when it was not started there or
    failed there (so a failure shows in the test that asked)."""
    future = futures.get((kind, *args))
    if future is not None and future.exception() is None:  # waits for it
        return future.result()
    return RUNS[kind](*args)


@pytest.fixture(scope="session")
def unfused_greedy(_engine_runs_started: dict[tuple, Future]
                   ) -> Callable[[str, str, str], list[list[int]]]:
    """``unfused_greedy(path, backend, kv_cache_dtype="auto")``: :func:`unfused_run` once per
    session for each argument triple (the Triton tests, interpreted, several seconds a run,
    compare against the same unfused and torch-backend runs), taken from the background
    worker when it ran it (``_engine_runs_started``)."""

    @functools.cache
    def run(path: str, backend: str, kv_cache_dtype: str = "auto") -> list[list[int]]:
        return _from_background(_engine_runs_started, "unfused", path, backend, kv_cache_dtype)

    return run


@pytest.fixture(scope="session")
def fused_greedy(_engine_runs_started: dict[tuple, Future]
                 ) -> Callable[[str, str, bool], FusedRun]:
    """``fused_greedy(path, kv_cache_dtype="auto", count_construction=True)``: the
    :func:`fused_run`, taken from the background worker when it ran it."""

    def run(path: str, kv_cache_dtype: str = "auto", count_construction: bool = True
            ) -> FusedRun:
        return _from_background(_engine_runs_started, "fused", path, kv_cache_dtype,
                                count_construction)

    return run
