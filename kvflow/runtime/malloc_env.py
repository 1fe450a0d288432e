"""glibc malloc settings for a CPU engine: keep freed memory for the next step instead of
handing it back to the kernel and faulting it in again.

torch allocates CPU tensors with glibc's ``posix_memalign``. By default glibc serves a large
request (>= ``M_MMAP_THRESHOLD``, 128 KiB at first, raised dynamically up to 32 MiB) with its
own ``mmap`` and unmaps it on ``free``, and trims the top of the heap once more than
``M_TRIM_THRESHOLD`` of it is free. A prefill step allocates and frees a few MiB-sized
activations per layer (SmolLM2-135M, 2,048 tokens: a 12 MiB gate/up output per layer), so each
step mapped fresh pages and took about 95,000 minor page faults (CPU-W1, ``getrusage``), each
a kernel entry that zeroes a page; decode steps took none. With both thresholds fixed high the
heap keeps its peak size and every step reuses the same pages.

Cost: the process keeps the peak of its freed heap memory mapped (the largest step's
activations, tens of MiB for small models) instead of returning it between steps.

:func:`keep_freed_memory` runs when a CPU model runner starts. A ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` the user set wins (glibc read it at start-up). Other C libraries
(musl) and other allocators (a preloaded jemalloc or tcmalloc) have no ``mallopt`` of these
meanings; there it does nothing.

:func:`release_freed_memory` is the way back: sleep mode calls it (through
``CpuPlatform.empty_cache``) once the KV cache is freed, so tensors smaller than the raised
mmap threshold (a small model's per-layer KV tensors) leave the process's RSS too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# mallopt parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# the largest M_MMAP_THRESHOLD glibc accepts on 64-bit machines (DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # free heap top kept before trimming: 1 GiB
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory(environ: Mapping[str, str] | None = None, libc=None) -> bool:
    """Raise glibc's mmap and trim thresholds (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`)
    so freed activations stay in the heap for the next step (see the module docstring).

    Args:
        environ: the environment to look for the user's ``MALLOC_*`` settings in (default
            ``os.environ``).
        libc: the C library to call (default: this process's glibc, loaded by ctypes).

    Returns:
        True when both settings were applied; False when the user set either variable, the C
        library is not glibc, or ``mallopt`` refused a value (logged at debug level).
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in USER_SETTINGS):
        return False
    libc = _glibc() if libc is None else libc
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.debug("mallopt refused the mmap/trim thresholds; malloc keeps its defaults")
    return ok


def _glibc():
    """This process's glibc loaded by ctypes, or None under another C library."""
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def release_freed_memory(libc=None) -> bool:
    """Hand the heap's free pages back to the kernel now (glibc ``malloc_trim(0)``: the top of
    the heap and whole free pages inside it), whatever the thresholds
    :func:`keep_freed_memory` raised.

    Args:
        libc: the C library to call (default: this process's glibc, loaded by ctypes).

    Returns:
        True when memory was released; False when nothing was, or the C library is not glibc.
    """
    libc = _glibc() if libc is None else libc
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))
