"""``--gpu-memory-utilization`` sizes a GPU's KV cache from its memory; a CPU engine's KV cache
is ``--kv-cache-memory`` (2 GiB by default) whatever the fraction, so a fraction given there is
refused, naming the flag to use, instead of being ignored: ``--gpu-memory-utilization 0.1`` on
CPU used to start an engine with the same 2 GiB cache in silence. Unset, a GPU still takes
0.9 of its memory."""

from __future__ import annotations

import pytest

from kvflow import LLM
from kvflow.config import CacheConfig
from kvflow.entrypoints.cli import main


def test_a_fraction_on_cpu_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization=0.5 sizes a GPU's KV cache;"
                                         r" on cpu .*--kv-cache-memory"):
        LLM(model=tiny_llama.path, device="cpu", dtype="float32", gpu_memory_utilization=0.5)


def test_the_flag_on_cpu_is_one_line(tiny_llama, capsys):
    rc = main(["generate", "--model", tiny_llama.path, "--device", "cpu",
               "--gpu-memory-utilization", "0.1", "--max-tokens", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvflow: error: --gpu-memory-utilization=0.1 sizes a GPU's KV "
                               "cache; on cpu"), lines[0]


def test_unset_means_nine_tenths_on_a_gpu():
    assert CacheConfig().gpu_memory_fraction == 0.9
    assert CacheConfig(gpu_memory_utilization=0.5).gpu_memory_fraction == 0.5
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.0 must be in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=0.0)
