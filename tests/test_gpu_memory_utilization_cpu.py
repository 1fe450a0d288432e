"""``--gpu-memory-utilization`` sizes a GPU's KV cache from its memory; a CPU engine's KV cache
is ``--kv-cache-memory`` (2 GiB by default) whatever the fraction, so a fraction given there is
refused, naming the flag to use, instead of being ignored: ``--gpu-memory-utilization 0.1`` on
CPU used to start an engine with the same 2 GiB cache in silence. Unset, a GPU still takes
0.9 of its memory. Two KV-cache size settings given together (``--num-kv-blocks``,
``--kv-cache-memory``, ``--gpu-memory-utilization``) are refused on any device, since the
engine reads only the first: on a GPU an explicit size left the fraction unread in silence."""

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


ONLY_ONE = "both size the KV cache, and only the first would be read; give one of them"


@pytest.mark.parametrize("kwargs, message", [
    # on a GPU the explicit size won and the fraction was read by nothing
    ({"kv_cache_memory": "2GiB", "gpu_memory_utilization": 0.5},
     "kv_cache_memory='2GiB' and gpu_memory_utilization=0.5"),
    ({"num_kv_blocks": 64, "gpu_memory_utilization": 0.8},
     "num_kv_blocks=64 and gpu_memory_utilization=0.8"),
    # the block count won and the memory size was read by nothing, on any device
    ({"num_kv_blocks": 64, "kv_cache_memory": 2**30},
     "num_kv_blocks=64 and kv_cache_memory=1073741824"),
])
def test_two_kv_cache_sizes_are_refused_on_any_device(kwargs, message):
    from kvflow.config import EngineConfig

    with pytest.raises(ValueError) as e:
        CacheConfig(**kwargs)
    assert str(e.value) == f"{message} {ONLY_ONE}"
    for device in ("cuda", "cpu"):
        with pytest.raises(ValueError, match="both size the KV cache"):
            EngineConfig.from_kwargs(model="m", device=device, **kwargs)


def test_one_size_with_the_default_fraction_is_fine():
    """The fraction unset (its 0.9 a default, not a choice) goes with any one explicit size;
    each is read as given."""
    assert CacheConfig(kv_cache_memory="2GiB").gpu_memory_utilization is None
    assert CacheConfig(num_kv_blocks=64).gpu_memory_fraction == 0.9
    assert CacheConfig(gpu_memory_utilization=0.5).kv_cache_memory is None


def test_both_flags_are_one_line_naming_the_flags(tiny_llama, capsys):
    rc = main(["generate", "--model", tiny_llama.path, "--device", "cuda",
               "--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.7",
               "--max-tokens", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0] == ("kvflow: error: --kv-cache-memory='1GiB' and "
                        "--gpu-memory-utilization=0.7 both size the KV cache, and "
                        "only the first would be read; give one of them"), lines[0]
