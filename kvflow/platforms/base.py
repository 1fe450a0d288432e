"""The Platform interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Platform(ABC):
    """Device facts the engine needs: device, default dtype, attention backend, memory.

    A third-party platform (another vendor's GPU, an NPU) subclasses this in its own package
    and registers the class under the ``kvflow.platform_plugins`` entry point group; ``--device
    <name>`` then selects it (see :func:`kvflow.platforms.get_platform` and "Adding a
    platform" in docs/architecture.md). It must give ``name``, ``device_type``, ``device``,
    ``default_dtype`` and ``memory_info``; everything else has a default here.
    """

    # ``name`` is also the suffix of the ``forward_<name>`` that custom ops run for tensors of
    # ``device_type`` (the torch device type this platform's tensors carry); see
    # :func:`kvflow.platforms.op_dispatch_key`.
    name: str = "abstract"
    device_type: str = "abstract"
    default_attention_backend: str = "torch"
    # Token budget of an engine step when the user gives none (--max-num-batched-tokens).
    default_max_num_batched_tokens: int = 4096
    supports_graphs: bool = False
    # --async-scheduling when the user gives neither form of the flag: worth it only where the
    # forward pass runs asynchronously to the host (a device queue).
    default_async_scheduling: bool = False
    # KV-cache bytes when neither --kv-cache-memory nor --num-kv-blocks is given; None: what a
    # profiling forward pass leaves of --gpu-memory-utilization x memory_info()'s total.
    default_kv_cache_bytes: int | None = None
    # torch.distributed backend of the collectives between this platform's devices; a plugin
    # platform names its own (e.g. "hccl", "xccl").
    dist_backend: str = "gloo"

    @staticmethod
    def is_available() -> bool:
        """Whether this platform's device is present (``--device <name>`` refuses it if not)."""
        return True

    def get_attention_backend(self, name: str) -> Any:
        """The platform's own attention backend called ``name`` (an
        :class:`kvflow.attention.backend.AttentionBackend`), or None to use kvflow's (torch,
        cpu, triton). A plugin returns its kernels here and names one in
        ``default_attention_backend``."""
        return None

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """Compute dtype used when the model does not say (``--dtype auto``)."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory."""

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its device among the machine's (worker ``local_rank``); a
        no-op where there is one device (CPU)."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def reset_peak_memory(self) -> None:
        """Release cached blocks and reset the peak-allocation counter (no-op on CPU)."""

    def empty_cache(self) -> None:
        """Hand the allocator's cached free blocks back to the device (no-op on CPU)."""

    def peak_memory(self) -> int:
        """Bytes allocated at the peak since ``reset_peak_memory`` (0 where unknown)."""
        return 0

    def peak_memory_reserved(self) -> int:
        """Bytes this process's allocator holds from the device now (0 where unknown)."""
        return 0

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Whether the device computes in ``dtype`` (``--dtype auto`` falls back to
        ``default_dtype()`` for a checkpoint dtype it does not)."""
        return True

    def check_kv_cache_dtype(self, kv_cache_dtype: str, attention_backend: str) -> None:
        """Raises ValueError when ``--kv-cache-dtype`` cannot run with ``attention_backend``
        (the backend's name) on this device; nothing here."""

    def check_dtype(self, dtype: torch.dtype, flag: str) -> None:
        """Raises ValueError (naming ``flag``, e.g. ``dtype='bfloat16'``) when the device
        cannot compute in ``dtype``; nothing here."""

    def has_native_matmul(self, dtype: torch.dtype) -> bool:
        """Whether matmuls in ``dtype`` run on units built for it (else the engine widens
        16-bit GEMMs to fp32, see :mod:`kvflow.kernels.gemm`)."""
        return True

    def prepacks_gemm_weights(self, dtype: torch.dtype) -> bool:
        """Whether GEMM weights in ``dtype`` are packed once after loading
        (:func:`kvflow.kernels.gemm.prepack_gemm_weights`)."""
        return False
