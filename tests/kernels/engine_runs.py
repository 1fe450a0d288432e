"""The Triton engine runs that tests/kernels/test_engine_triton_cpu.py and
test_fused_kernels_engine.py compare (interpreted Triton on CPU, several seconds each), as
plain functions: conftest.py runs them ahead in a worker process (:func:`run_in_child`) or,
failing that, in the test process."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.kernels.triton_setup import use_interpreter


def unfused_run(path: str, backend: str, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """The greedy tokens of ``tests.kernels.test_engine_triton_cpu._greedy`` on an engine
    built with ``KVFLOW_FUSED_KERNELS=0`` (the default)."""
    from tests.kernels.test_engine_triton_cpu import _greedy, _llm

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLOW_FUSED_KERNELS", "0")
        llm = _llm(path, backend, kv_cache_dtype)
    return _greedy(llm)


@dataclass(frozen=True)
class FusedRun:
    """A :func:`fused_run`: greedy tokens, the calls of each counted kernel and the model's
    layer count."""

    tokens: list[list[int]]
    calls: dict[str, int]
    num_layers: int


COUNTED = (("kvflow.attention.triton_paged", "rotary_store_kvcache"),
           ("kvflow.attention.triton_paged", "store_kvcache"),
           ("kvflow.kernels.rotary", "rotary_embedding"))


def fused_run(path: str, kv_cache_dtype: str = "auto",
              count_construction: bool = True) -> FusedRun:
    """The greedy tokens of ``tests.kernels.test_engine_triton_cpu._greedy`` on a Triton
    engine built with ``KVFLOW_FUSED_KERNELS=1``, counting the calls of the fused rotary +
    KV-store kernel and of the separate store and rotary kernels (``COUNTED``), from before
    the engine is built or, with ``count_construction`` False, from its first request."""
    from tests.kernels.test_engine_triton_cpu import _greedy, _llm

    calls = {name: 0 for _, name in COUNTED}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLOW_FUSED_KERNELS", "1")

        def count() -> None:
            for module_name, name in COUNTED:
                module = importlib.import_module(module_name)
                original = getattr(module, name)

                def counted(*args, _original=original, _name=name, **kwargs):
                    calls[_name] += 1
                    return _original(*args, **kwargs)

                mp.setattr(module, name, counted)

        if count_construction:
            count()
        llm = _llm(path, "triton", kv_cache_dtype)
        if not count_construction:
            count()
        tokens = _greedy(llm)
    return FusedRun(tokens, calls, llm.engine.core.executor.runner.model.config.num_hidden_layers)


RUNS = {"unfused": unfused_run, "fused": fused_run}


def run_in_child(kind: str, *args: Any) -> Any:
    """``RUNS[kind](*args)`` in the spawned worker process, set up as the tests are (the
    Triton interpreter as tests/kernels/conftest.py sets it up; one torch thread, as
    tests/conftest.py sets it)."""
    use_interpreter()
    torch.set_num_threads(int(os.environ.get("KVFLOW_TEST_NUM_THREADS", "1")))
    return RUNS[kind](*args)
