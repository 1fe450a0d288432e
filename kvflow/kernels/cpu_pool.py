"""kvflow's straggler-tolerant CPU thread pool for the native GEMM (``csrc/cpu_pool.c``,
``--cpu-work-sharing pool``).

An OpenMP parallel region ends when every thread of its team has arrived. Beside a busy
process on one of two cores, the thread that shares that core is descheduled for whole time
slices, and each of an engine step's hundreds of regions waits for it: the step runs at the
pace of the shared core whatever the split (docs/benchmarks.md, "CPU threads beside a busy
process"). In the pool the calling thread and the workers claim the GEMM's (row block, weight
panel) items one at a time; the caller never waits for a worker that has not started, and an
item a worker holds for more than about twice the caller's time per item is computed again by
the caller (the worker's copy, computed into private scratch, is then dropped). Every output
element is still computed by one thread in one fixed order, so results equal the OpenMP path's
bit for bit.

Bound on the library :func:`kvflow.kernels.cpu_native.native_cpu_kernels` builds.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kvflow.kernels.cpu_native import NativeCpuKernels, gemm_out_code

_i64, _int, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
DEFAULT_SPIN_US = 50  # an idle worker's spin before it sleeps (one decode GEMM is ~50-500 us)


@functools.cache
def _entries(lib: ctypes.CDLL) -> dict[str, ctypes._CFuncPtr]:
    specs = {"kvflow_pool_create": (_ptr, [_int, _ptr, _i64]),
             "kvflow_pool_destroy": (None, [_ptr]),
             "kvflow_pool_workers": (_int, [_ptr]),
             "kvflow_pool_late_workers": (_int, [_ptr]),
             "kvflow_pool_set_worker_delay": (None, [_ptr, _i64]),
             "kvflow_pool_stats": (None, [_ptr, _ptr]),
             "kvflow_gemm_pooled": (_int, [_ptr, _ptr, _i64, _int, _ptr, _int, _ptr, _ptr, _i64,
                                           _int, _i64, _i64, _i64, _int]),
             "kvflow_paged_attention_pooled": (_int, [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr,
                                                      _i64, _i64, _ptr, _ptr, _i64, _i64, _i64,
                                                      _i64, _i64, _f32, _i64, _f32, _int, _int,
                                                      _int])}
    entries = {}
    for name, (restype, argtypes) in specs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
        entries[name] = fn
    return entries


class CpuPool:
    """``num_workers`` threads that, with the thread calling :meth:`gemm`, share its items.

    Args:
        kernels: the loaded native kernels.
        num_workers: threads besides the caller (the caller counts as one compute thread, so an
            engine with T compute threads uses T - 1).
        cpus: pin worker i to ``cpus[i]`` (None: not pinned).
        spin_us: microseconds an idle worker spins before it sleeps.

    Raises:
        ValueError: when ``cpus`` does not give one CPU per worker.
        MemoryError: when the pool cannot be created.
    """

    def __init__(self, kernels: NativeCpuKernels, num_workers: int,
                 cpus: list[int] | None = None, spin_us: int = DEFAULT_SPIN_US) -> None:
        if cpus is not None and len(cpus) != num_workers:
            raise ValueError(f"{len(cpus)} CPUs given for {num_workers} pool workers")
        self.kernels, self._fn, self.cpus = kernels, _entries(kernels.lib), cpus
        ids = None if cpus is None else torch.tensor(cpus, dtype=torch.int32)
        handle = self._fn["kvflow_pool_create"](num_workers,
                                                None if ids is None else ids.data_ptr(), spin_us)
        if not handle:
            raise MemoryError("could not create the CPU thread pool")
        self._handle: int | None = handle
        self._pid = os.getpid()  # a forked child has the pool's memory but not its threads
        # packed weights a late worker may still be reading (kept alive until it is done)
        self._in_use: dict[int, torch.Tensor] = {}

    @property
    def num_workers(self) -> int:
        """Worker threads running (fewer than asked if the system refused threads)."""
        return self._fn["kvflow_pool_workers"](self._live())

    @property
    def is_open(self) -> bool:
        """Whether :meth:`gemm` can run (not closed, not a forked child's copy)."""
        if self._handle is not None and os.getpid() != self._pid:
            self.close()
        return self._handle is not None

    def _live(self) -> int:
        if not self.is_open:
            raise ValueError("the CPU thread pool is closed")
        return self._handle

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int,
             bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:meth:`NativeCpuKernels.gemm` with the work shared through this pool; the same
        arguments, checks and (bitwise) result. While a worker descheduled mid-item may still
        read ``packed`` after this returns, the pool keeps a reference to it.

        Raises:
            ValueError: on a dtype, device or size mismatch, or a closed pool (in a forked
                child the pool is closed: its threads stayed in the parent).
        """
        rows, code, x_code = self.kernels.gemm_operands(x, packed, n, bias)
        out = torch.empty(rows.shape[0], n, dtype=out_dtype)
        status = self._fn["kvflow_gemm_pooled"](
            self._live(), rows.data_ptr(), rows.stride(0), x_code, packed.data_ptr(), code,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n,
            gemm_out_code(out_dtype), rows.shape[0], n, x.shape[-1], torch.get_num_threads())
        if status:
            raise ValueError("gemm: x does not have the dtype the packed weight takes")
        self._note_late(packed)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def paged_attention(self, kv_cache: torch.Tensor, *args) -> int:
        """``kvflow_paged_attention_pooled`` (``csrc/cpu_attention.c``) with the raw arguments
        :meth:`NativeCpuKernels.paged_attention` prepares (checked there); returns the kernel's
        status. A tile is a work item; q and the index arrays are copied into the pool, and
        ``kv_cache`` is kept referenced while a late worker may still read it.

        Raises:
            ValueError: on a closed pool.
        """
        status = self._fn["kvflow_paged_attention_pooled"](self._live(), *args)
        self._note_late(kv_cache)
        return status

    def _note_late(self, tensor: torch.Tensor) -> None:
        if self._fn["kvflow_pool_late_workers"](self._handle):
            self._in_use[tensor.data_ptr()] = tensor
        elif self._in_use:
            self._in_use.clear()

    def set_worker_delay(self, delay_us: int) -> None:
        """Tests: make every worker sleep ``delay_us`` before each item (a worker on a core
        a busy process holds)."""
        self._fn["kvflow_pool_set_worker_delay"](self._live(), delay_us)

    def stats(self) -> dict[str, int]:
        """Items since creation: ``caller`` (computed by the calling thread), ``committed``
        (by workers), ``taken_over`` (recomputed by the caller from a late worker) and
        ``dropped`` (a late worker's results thrown away)."""
        out = torch.zeros(4, dtype=torch.int64)
        self._fn["kvflow_pool_stats"](self._live(), out.data_ptr())
        return dict(zip(("caller", "committed", "taken_over", "dropped"), out.tolist()))

    def close(self) -> None:
        """Stop and join the workers (each finishes the item it holds); idempotent. In a
        forked child (which has the pool's memory but none of its threads) it only lets go."""
        if self._handle is not None and os.getpid() != self._pid:
            self._handle = None
        if self._handle is not None:
            self._fn["kvflow_pool_destroy"](self._handle)
            self._handle = None
            self._in_use.clear()

    def __del__(self) -> None:
        self.close()

