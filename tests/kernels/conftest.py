"""Kernel-test setup: run Triton kernels in the interpreter (CPU) when there is no CUDA.

``TRITON_INTERPRET`` must be set before triton is first imported, so it is set here, at
conftest import time.  Test modules skip themselves if triton is missing.
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_for_numpy_2_4() -> None:
    """Work around triton-lang/triton#9171 (triton <= 3.6 interpreter + numpy >= 2.4).

    The interpreter stores scalars as 1-element arrays and converts them with
    ``int(array)``, which numpy 2.4 rejects, so ``range(runtime_scalar)`` inside a kernel
    fails.  Re-register ``__index__`` with an explicit ``.item()`` (the upstream fix).
    """
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # no triton: the test modules skip themselves
        return
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_kvflow_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._kvflow_patched = True
    interp._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_for_numpy_2_4()


@pytest.fixture(scope="module")
def tiny_llama_path(tiny_llama) -> str:
    """The session's tiny Llama (tests/conftest.py), saved with its tokenizer: engine-level
    kernel tests compare backends on it."""
    return tiny_llama.path


# Every unfused run the Triton engine tests compare against: (tiny model, backend, KV-cache
# dtype), in the order the tests ask for them.
UNFUSED_RUNS = [("llama", "torch", "auto"), ("llama", "triton", "auto"),
                ("llama", "torch", "int8"), ("llama", "triton", "int8"),
                ("llama", "torch", "fp8_e4m3"), ("llama", "triton", "fp8_e4m3"),
                ("qwen3", "triton", "auto"), ("gemma3", "triton", "auto")]
UNFUSED_MODULES = ("test_engine_triton_cpu.py", "test_fused_kernels_engine.py")


def unfused_run(path: str, backend: str, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """The greedy tokens of ``tests.kernels.test_engine_triton_cpu._greedy`` on an engine
    built with ``KVFLOW_FUSED_KERNELS=0`` (the default)."""
    from tests.kernels.test_engine_triton_cpu import _greedy, _llm

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLOW_FUSED_KERNELS", "0")
        llm = _llm(path, backend, kv_cache_dtype)
    return _greedy(llm)


def _unfused_run_in_child(path: str, backend: str, kv_cache_dtype: str) -> list[list[int]]:
    """:func:`unfused_run` in a spawned worker process, set up as this conftest sets up the
    tests (Triton's interpreter and its numpy patch; one torch thread, as tests/conftest.py)."""
    torch.set_num_threads(int(os.environ.get("KVFLOW_TEST_NUM_THREADS", "1")))
    return unfused_run(path, backend, kv_cache_dtype)


@pytest.fixture(scope="session", autouse=True)
def _unfused_runs_started(request: pytest.FixtureRequest) -> Iterator[dict[tuple, Future]]:
    """When the session runs the Triton engine tests (``UNFUSED_MODULES``), start every
    ``UNFUSED_RUNS`` run at the first kernel test, in one spawned worker process: the runs
    (interpreted Triton, several seconds each) proceed on the other core while the kernel
    tests before those modules run. {(path, backend, kv dtype): its Future}; empty when
    not needed or when triton is missing."""
    wanted = any(getattr(item, "path", None) is not None and item.path.name in UNFUSED_MODULES
                 for item in request.session.items)
    if not wanted or os.environ.get("TRITON_INTERPRET") != "1" or \
            importlib.util.find_spec("triton") is None:
        yield {}
        return
    factory = request.getfixturevalue("tiny_model_factory")
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    futures = {}
    for name, backend, kv_cache_dtype in UNFUSED_RUNS:
        key = (factory(name).path, backend, kv_cache_dtype)
        futures[key] = pool.submit(_unfused_run_in_child, *key)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def unfused_greedy(_unfused_runs_started: dict[tuple, Future]
                   ) -> Callable[[str, str, str], list[list[int]]]:
    """``unfused_greedy(path, backend, kv_cache_dtype="auto")``: :func:`unfused_run` once per
    session for each argument triple (the Triton tests, interpreted, several seconds a run,
    compare against the same unfused and torch-backend runs). A triple started in the
    background worker (``_unfused_runs_started``) is taken from it; one that was not, or
    whose worker run failed, runs here (so a failure shows in the test that asked)."""

    @functools.cache
    def run(path: str, backend: str, kv_cache_dtype: str = "auto") -> list[list[int]]:
        future = _unfused_runs_started.get((path, backend, kv_cache_dtype))
        if future is not None and future.exception() is None:  # waits for it
            return future.result()
        return unfused_run(path, backend, kv_cache_dtype)  # a failure shows here

    return run
