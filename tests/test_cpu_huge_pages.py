"""Large CPU tensors advised onto transparent huge pages (kvflow/platforms/cpu_memory.py): the
advised range is exactly the whole 2 MB pages inside the tensor, the tensor holds zeros, and the
engine's CPU KV cache goes through it."""

from __future__ import annotations

import sys

import pytest
import torch

from kvflow.platforms import cpu_memory
from kvflow.platforms.cpu_memory import HUGE_PAGE, advise_huge_pages, zeros_on_huge_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


@linux
def test_advises_the_whole_huge_pages_inside_the_tensor():
    t = torch.empty(5 * HUGE_PAGE + 12345, dtype=torch.uint8)
    ptr = t.data_ptr()
    first = -(-ptr // HUGE_PAGE) * HUGE_PAGE
    last = (ptr + t.numel()) // HUGE_PAGE * HUGE_PAGE
    assert advise_huge_pages(t) == last - first >= 4 * HUGE_PAGE


def test_small_or_non_cpu_tensors_are_left_alone():
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)) == 0
    assert advise_huge_pages(torch.empty(0)) == 0


@linux
def test_zeros_on_huge_pages_are_zeros():
    t = zeros_on_huge_pages((3, HUGE_PAGE // 2 + 7), torch.bfloat16)
    assert t.shape == (3, HUGE_PAGE // 2 + 7) and t.dtype == torch.bfloat16
    assert int(t.count_nonzero()) == 0


def test_cpu_kv_cache_is_allocated_through_it(monkeypatch, tiny_llama):
    from kvflow import LLM, SamplingParams

    calls = []
    real = cpu_memory.zeros_on_huge_pages

    def spy(shape, dtype):
        calls.append((tuple(shape), dtype))
        return real(shape, dtype)

    monkeypatch.setattr("kvflow.worker.kv_cache_setup.zeros_on_huge_pages", spy)
    llm = LLM(model=tiny_llama.path, kv_cache_memory="16MiB", enable_prefix_caching=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert calls and all(shape[0] == 2 and len(shape) == 5 for shape, _ in calls)
