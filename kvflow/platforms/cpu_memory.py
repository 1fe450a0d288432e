"""Large CPU tensors on transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``).

A decode step's attention reads every request's K/V from blocks scattered over the whole cache
(hundreds of MB): with 4 KB pages nearly every 6 KB block costs a TLB miss and a page walk,
which in a virtual machine walks two page tables. On 2 MB pages one TLB entry covers 340 such
blocks. On the issue-23 Xeon (KVM guest) one core read 6 KB blocks in random order at 7.0 GB/s
on 4 KB pages and 8.7 GB/s on huge pages, both with software prefetch
(``benchmarks/cpu_kv_bandwidth.c``, docs/benchmarks.md).

Linux backs an advised range with huge pages as it first touches it, where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always`` (with ``never``
the advice is a no-op). Only whole 2 MB-aligned pages inside the tensor are advised.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    """libc's madvise with its argument types, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def advise_huge_pages(t: torch.Tensor) -> int:
    """Advise the kernel to back ``t``'s memory (a CPU tensor, best not yet touched) with
    transparent huge pages. Returns the bytes advised: 0 for a tensor smaller than a 2 MB page,
    off Linux, on another device, or when the kernel refuses."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return 0
    ptr, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
    start = (ptr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or madvise(start, end - start, MADV_HUGEPAGE) != 0:
        return 0
    return end - start


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, advised onto huge pages
    (:func:`advise_huge_pages`) before the zeros first touch it."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()
