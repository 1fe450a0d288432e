"""The CPU platform: native C attention (torch where it cannot be built), bf16 when the CPU has
native bf16 matmuls."""

from __future__ import annotations

import os
import platform

import torch

from kvflow.config.cpu_isa import cpu_features
from kvflow.platforms.base import Platform
from kvflow.runtime.malloc_env import release_freed_memory


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    default_attention_backend = "cpu"  # native kernels; "torch" where they cannot be built
    # 2,048-token prefill steps keep a step's activations (2,048 x 3,072 fp32 = 25 MB for
    # SmolLM2's gate_up) within the L3 cache; measured ~10% faster prefill than 4,096 on a
    # 2-core EPYC, and new requests wait half as long behind a step (docs/benchmarks.md).
    default_max_num_batched_tokens = 2048
    default_kv_cache_bytes = 2 * 2**30  # whatever the model (--kv-cache-memory to change it)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def empty_cache(self) -> None:
        """Hand the heap's free pages back to the kernel (glibc ``malloc_trim``; sleep mode
        calls it once the KV cache is freed, so the process's RSS drops)."""
        release_freed_memory()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.has_native_matmul(torch.bfloat16) else torch.float32

    def has_native_matmul(self, dtype: torch.dtype) -> bool:
        """bf16 needs AVX512-BF16 or AMX, fp16 AVX512-FP16 or AMX-FP16 (as oneDNN reports;
        for bf16 on x86 also the CPU's own flags: :func:`x86_lacks_bf16_units`)."""
        if dtype == torch.float32:
            return True
        if not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) \
                and not x86_lacks_bf16_units(cpu_features(), platform.machine())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        return False

    def prepacks_gemm_weights(self, dtype: torch.dtype) -> bool:
        """oneDNN can pack weights of ``dtype`` once (``_reorder_linear_weight``) where torch
        has oneDNN: fp32 always, 16-bit where the CPU has native matmul units for it (which
        kernel each GEMM then runs is timed, ``kernels/gemm_select.py``)."""
        return torch.backends.mkldnn.is_available() \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
            and (dtype == torch.float32 or self.has_native_matmul(dtype))

    def memory_info(self) -> tuple[int, int]:
        """(available, total) bytes: Linux's ``MemAvailable`` (free pages plus the page cache
        and other memory the kernel can reclaim without swapping), else the free pages. Free
        pages alone shrink to almost nothing once files have filled the page cache, and the
        KV-cache check then refused caches the machine could hold."""
        pages = host_memory_bytes()
        avail = mem_available(MEMINFO)
        if avail is None:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return avail, pages


MEMINFO = "/proc/meminfo"
# /proc/cpuinfo flags of x86 bf16 dot-product units (AVX512-BF16: Zen 4/5, Cooper Lake and
# later Xeons; AMX-BF16: Sapphire Rapids and later)
X86_BF16_UNIT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def x86_lacks_bf16_units(features: frozenset[str], machine: str) -> bool:
    """Whether an x86 CPU (``machine``: ``platform.machine()``, e.g. ``x86_64``) with the
    ``/proc/cpuinfo`` flags ``features`` has no bf16 matmul units (none of
    :data:`X86_BF16_UNIT_FLAGS`); False off x86 and where the flags are unknown (empty).

    Why: oneDNN (torch's ``_is_mkldnn_bf16_supported``) reports bf16 on any AVX512 core and
    emulates it there. On a 2-core Ice Lake Xeon (avx512f, no avx512_bf16) oneDNN's bf16
    GEMMs ran 2.4-2.8x slower than kvflow's bf16 GEMM at 64 and 2,048 rows (SmolLM2's four
    layer shapes), and ``--dtype auto`` spent 15-18 CPU s of a first start timing bf16 against
    fp32 to pick fp32 anyway (docs/benchmarks.md, session 51). Without units ``--dtype auto``
    times kvflow's own bf16 GEMM (weights widened in registers) against fp32 instead
    (``core/engine_dtype.py: cpu_dtype_measure``)."""
    if machine.lower() not in ("x86_64", "amd64") or not features:
        return False
    return not features & X86_BF16_UNIT_FLAGS


def host_memory_bytes() -> int:
    """The machine's physical memory in bytes (``SC_PHYS_PAGES`` x ``SC_PAGE_SIZE``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def mem_available(path: str) -> int | None:
    """``MemAvailable`` of a ``/proc/meminfo``-format file in bytes; None where the file or the
    field is missing (not Linux, kernels before 3.14)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        return None
    return None
