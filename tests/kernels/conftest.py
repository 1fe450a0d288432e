"""Kernel-test setup: run Triton kernels in the interpreter (CPU) when there is no CUDA.

``TRITON_INTERPRET`` must be set before triton is first imported, so it is set here, at
conftest import time.  Test modules skip themselves if triton is missing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

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


@pytest.fixture(scope="session")
def unfused_greedy() -> Callable[[str, str, str], list[list[int]]]:
    """``unfused_greedy(path, backend, kv_cache_dtype="auto")``: the greedy tokens of
    ``tests.kernels.test_engine_triton_cpu._greedy`` on an engine built with
    ``KVFLOW_FUSED_KERNELS=0`` (the default), run once per session for each argument triple:
    the Triton tests (interpreted, several seconds a run) compare against the same unfused
    and torch-backend runs."""
    from tests.kernels.test_engine_triton_cpu import _greedy, _llm

    @functools.cache
    def run(path: str, backend: str, kv_cache_dtype: str = "auto") -> list[list[int]]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVFLOW_FUSED_KERNELS", "0")
            llm = _llm(path, backend, kv_cache_dtype)
        return _greedy(llm)

    return run
