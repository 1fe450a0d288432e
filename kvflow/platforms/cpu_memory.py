"""Large CPU tensors on transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``).

A decode step's attention reads every request's K/V from blocks scattered over the whole cache
(hundreds of MB): with 4 KB pages nearly every 6 KB block costs a TLB miss and a page walk,
which in a virtual machine walks two page tables. On 2 MB pages one TLB entry covers 340 such
blocks. On the issue-23 Xeon (KVM guest) one core read 6 KB blocks in random order at 7.0 GB/s
on 4 KB pages and 8.7 GB/s on huge pages, both with software prefetch
(``benchmarks/cpu_kv_bandwidth.c``, docs/benchmarks.md).

A decode step also streams every weight once. The CPU GEMM's packed weights are mostly 0.5-4 MB
each, too small for a 2 MB page of their own, so :class:`HugePageArena` places them side by side
in a few large advised allocations: with 4 KB pages the hardware prefetchers stop at every page
boundary and each 4 KB of weights costs a TLB miss (docs/benchmarks.md, "session 39: packed
weights on huge pages").

Linux backs an advised range with huge pages as it first touches it, where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always`` (with ``never``
the advice is a no-op). Only whole 2 MB-aligned pages inside the tensor are advised.

The KV cache (:func:`zeros_on_huge_pages`) is a fresh anonymous mapping, which the kernel hands
out zeroed: nothing writes zeros into it. Its first touch of each page (the kernel's fault,
which clears the page) is what took the time: 2 GiB on huge pages took 8-49 s in a Firecracker
VM (docs/benchmarks.md, session 48), on the way to the engine's ready. So
:func:`prefault_in_background` takes those faults (``madvise(MADV_POPULATE_WRITE)``, Linux
5.14: pages are backed without their contents changing, so the model may already write K/V
beside it): each K and V plane's first 2 MB page before ready (the blocks the first requests
get), the rest in a thread of its own while the engine serves, only while no step runs
(:class:`StepGate`); a page it has not reached yet is faulted by the step that first writes
it, as any fresh page is.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import torch

from kvflow.runtime.exit_threads import ExitJoinedThread

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
PAGE = mmap.PAGESIZE
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14; EINVAL before
PREFAULT_CHUNK = HUGE_PAGE  # bytes of each plane per madvise call of the prefault thread
PREFAULT_FIRST = HUGE_PAGE  # bytes of each plane populated before the thread starts
PREFAULT_IDLE_S = 0.05  # the prefault thread waits until no step has run for this long
PREFAULT_NICE = 19  # the prefault thread's nice value: it takes only otherwise idle CPU
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise():
    """libc's madvise with its argument types, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent-huge-page mode, the bracketed word of ``path`` (``always``,
    ``madvise`` or ``never``: with ``never`` advised memory stays on 4 KB pages), or
    ``"unavailable"`` where the file is missing or unreadable (another OS, a kernel without
    THP)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def advise_huge_pages(t: torch.Tensor) -> int:
    """Advise the kernel to back ``t``'s memory (a contiguous CPU tensor, best not yet touched)
    with transparent huge pages. Returns the bytes advised: 0 for a tensor smaller than a 2 MB
    page, off Linux, on another device, or when the kernel refuses."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return 0
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    start = (ptr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or madvise(start, end - start, MADV_HUGEPAGE) != 0:
        return 0
    return end - start


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, advised onto huge pages
    (:func:`advise_huge_pages`) before anything touches it.

    On Linux the tensor is a fresh private anonymous mapping (zeroed by the kernel, so not
    written here, and returned to it when the tensor is freed), starting on a 2 MB boundary so
    that every whole huge page of it is advised; its storage is exactly the tensor's bytes.
    Its pages are backed as they are first touched (:func:`prefault_in_background` touches
    them ahead). Elsewhere, ``torch.zeros`` (advised where possible)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if _madvise() is None or nbytes < HUGE_PAGE:
        t = torch.empty(shape, dtype=dtype)
        advise_huge_pages(t)
        return t.zero_()
    # one huge page more than needed, to start on a 2 MB boundary (the rest is never touched)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    t = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=skip).view(shape)
    advise_huge_pages(t)  # the tensor holds the mapping; unmapped once both are gone
    return t


def populate(t: torch.Tensor) -> bool:
    """Back every page of ``t`` (a contiguous CPU tensor) with memory now, without changing its
    contents (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14): the faults a first write would
    take. Safe while other threads read and write ``t``. Returns False where the kernel or OS
    does not offer it (nothing done)."""
    madvise = _madvise()
    nbytes = t.numel() * t.element_size()
    if madvise is None or t.device.type != "cpu" or nbytes == 0:
        return False
    start = t.data_ptr() // PAGE * PAGE  # the pages holding the tensor's first and last bytes
    end = -(-(t.data_ptr() + nbytes) // PAGE) * PAGE
    return madvise(start, end - start, MADV_POPULATE_WRITE) == 0


def _planes(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s [2, num_blocks, ...] K and V halves (a KV cache tensor), else ``[t]``: each
    is prefaulted from its first block on, the blocks the pool hands out first."""
    return list(t.unbind(0)) if t.dim() == 5 and t.shape[0] == 2 else [t.view(-1)]


def _prefault_chunk(t: torch.Tensor, offset: int, chunk_bytes: int) -> tuple[bool, bool]:
    """Populate bytes [offset, offset + chunk_bytes) of each of ``t``'s planes; returns (any
    plane goes on past them, the kernel populated them)."""
    more = False
    for plane in _planes(t):
        step = max(chunk_bytes // plane.element_size(), 1)
        part = plane.view(-1)[offset // plane.element_size():][:step]
        if part.numel() and not populate(part):
            return False, False
        more = more or part.numel() == step
    return more, True


def lower_thread_priority(nice: int = PREFAULT_NICE) -> bool:
    """Give the calling thread alone the ``nice`` value (Linux: ``setpriority`` of a thread
    id sets that thread's, setpriority(2)); True if done. The prefault thread runs so: on a
    machine with a core to spare it runs there, on a busy one it leaves the CPU to the start-up
    and the steps (pages it has not reached are faulted by the steps that write them)."""
    with contextlib.suppress(OSError, AttributeError):
        if sys.platform.startswith("linux"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            return True
    return False


class StepGate:
    """When the engine's steps run, for the prefault thread to keep off their CPU: the worker
    wraps each step (or part of one) in :meth:`running`; :meth:`quiet` says whether none runs
    and none ended in the last ``seconds``. One writer thread (the steps'); readers only read
    two attributes."""

    def __init__(self) -> None:
        self._running = 0  # steps (parts) running now
        self._last_end = -math.inf  # time.monotonic() at the last one's end

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Wrap one step (or part of one)."""
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._last_end = time.monotonic()

    def quiet(self, seconds: float) -> bool:
        """No step runs now and none ended in the last ``seconds`` seconds."""
        return self._running == 0 and time.monotonic() - self._last_end >= seconds


def _wait_for_quiet(gate: StepGate | None, stop: threading.Event) -> bool:
    """Return once ``gate`` has been quiet for :data:`PREFAULT_IDLE_S` (at once without one):
    True, or False as soon as ``stop`` is set."""
    while gate is not None and not gate.quiet(PREFAULT_IDLE_S):
        if stop.wait(PREFAULT_IDLE_S):
            return False
    return not stop.is_set()


def _prefault(refs: list[weakref.ref], chunk_bytes: int, offset: int = 0,
              gate: StepGate | None = None, stop: threading.Event | None = None) -> None:
    """The prefault thread: the tensors' planes chunk by chunk from byte ``offset`` of each,
    round robin, each chunk once ``gate`` is quiet (no step running or just run), until done
    or ``stop`` is set. A tensor freed meanwhile (sleep mode) is skipped: the thread holds one
    only during its chunk."""
    lower_thread_priority()
    stop = stop or threading.Event()
    start, more = time.monotonic(), True
    while more:
        more = False
        for ref in refs:
            if not _wait_for_quiet(gate, stop):
                logger.debug("KV cache prefault stopped (interpreter exit)")
                return
            t = ref()
            if t is None:
                continue
            go_on, ok = _prefault_chunk(t, offset, chunk_bytes)
            del t
            if not ok:
                logger.debug("KV cache prefault: madvise(MADV_POPULATE_WRITE) refused")
                return
            more = more or go_on
        offset += chunk_bytes
    logger.debug("KV cache prefaulted in %.2f s", time.monotonic() - start)


def prefault_in_background(tensors: list[torch.Tensor], chunk_bytes: int = PREFAULT_CHUNK,
                           first_bytes: int = PREFAULT_FIRST,
                           gate: StepGate | None = None) -> threading.Thread | None:
    """Back ``tensors``' pages (contiguous CPU tensors, such as :func:`zeros_on_huge_pages`
    made) with memory (:func:`populate`): the first ``first_bytes`` of each plane now, in the
    caller's thread (the blocks the pool hands out first, which the first requests write), the
    rest in a daemon thread (at :data:`PREFAULT_NICE`: :func:`lower_thread_priority`),
    ``chunk_bytes`` of each plane at a time, in the pool's allocation order (block 0 up),
    each chunk only once ``gate`` (the engine's steps) has been quiet for
    :data:`PREFAULT_IDLE_S`. Returns the thread, or None where there is nothing to do (off
    Linux, no tensor, nothing left after the first bytes). The thread keeps no tensor alive:
    one freed meanwhile is skipped. Contents never change, so the tensors may be in use
    meanwhile; a page the thread has not reached is faulted by the step that first writes it.

    Why: with the whole cache left to a thread that ran beside the steps, the first request
    after ``/health`` faulted its blocks' pages itself (one 2 MB page per layer's K and V,
    about 8 ms each in a Firecracker VM) while the thread took the machine's other core: it
    took 1.5 s instead of 0.4 s on a quiet 2-core machine, and the next ones 10-100% longer
    (docs/benchmarks.md, session 48)."""
    if _madvise() is None or not tensors:
        return None
    for t in tensors if first_bytes > 0 else []:
        if not _prefault_chunk(t, 0, first_bytes)[1]:
            return None  # the kernel refuses MADV_POPULATE_WRITE: the steps fault them
    if not any(plane.numel() * plane.element_size() > first_bytes
               for t in tensors for plane in _planes(t)):
        return None
    # stopped and joined at exit: ended by the interpreter inside a torch call, the process
    # aborted (status 134) in about half of the short runs (kvflow/runtime/exit_threads.py)
    stop = threading.Event()
    thread = ExitJoinedThread(_prefault, ([weakref.ref(t) for t in tensors], chunk_bytes,
                                          first_bytes, gate, stop),
                              name="kvflow-kv-prefault", exit_timeout_s=10.0, stop=stop)
    thread.start()
    return thread


def stop_prefault(thread: threading.Thread | None) -> None:
    """Stop a :func:`prefault_in_background` thread (None: nothing to do) and wait until it
    has ended: at most the chunk it backs now (one ``madvise`` per plane), during which it
    holds that KV tensor. Call it before letting the tensors go (sleep mode) so that they are
    unmapped then: a thread at nice 19 on busy cores held one for seconds after the engine
    dropped it (a sleep returned with the KV memory still resident)."""
    if thread is None:
        return
    thread.stop.set()
    thread.join()


class HugePageArena:
    """Hands out 1-D CPU tensors placed side by side in large allocations ("segments") whose
    whole 2 MB pages are advised onto transparent huge pages before anything touches them.

    For many weights of 0.5-4 MB each (a small model's packed GEMM weights), which a tensor of
    their own could not put on huge pages. A tensor larger than ``segment_bytes`` gets a
    segment of its own. Each tensor starts on a ``ALIGN``-byte boundary. The tensors keep
    their segment alive (they are views of it), so the arena itself may be dropped once the
    tensors are made. A segment's unused tail is virtual memory never touched (up to one
    2 MB page of it backed where the last tensor ends inside that page).

    Args:
        segment_bytes: size of a shared segment (default 32 MiB); must be > 0.

    Raises:
        ValueError: for a non-positive ``segment_bytes``.
    """

    ALIGN = 64  # a cache line: the GEMM's loads need no more

    def __init__(self, segment_bytes: int = 32 << 20) -> None:
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be > 0, got {segment_bytes}")
        self.segment_bytes = segment_bytes
        self._segment: torch.Tensor | None = None  # uint8, starts on a 2 MB boundary
        self._used = 0
        self.advised_bytes = 0  # over all segments: what the kernel accepted

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-D tensor of ``numel`` elements of ``dtype`` in the arena.

        Raises:
            ValueError: for a negative ``numel``.
        """
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if self._segment is None or start + nbytes > self._segment.numel():
            if nbytes > self.segment_bytes:
                return self._new_segment(nbytes)[:nbytes].view(dtype)
            self._segment, start = self._new_segment(self.segment_bytes), 0
        self._used = start + nbytes
        return self._segment[start:start + nbytes].view(dtype)

    def _new_segment(self, nbytes: int) -> torch.Tensor:
        """A fresh advised uint8 tensor of ``nbytes`` (rounded up to whole 2 MB pages)
        starting on a 2 MB boundary (the allocation is one page larger to allow for that)."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % HUGE_PAGE
        segment = raw[skip:skip + size]
        self.advised_bytes += advise_huge_pages(segment)
        return segment
