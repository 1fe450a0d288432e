"""The Platform interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Platform(ABC):
    """Device facts the engine needs: device, default dtype, attention backend, memory."""

    # ``name`` is also the suffix of the ``forward_<name>`` that custom ops run for tensors of
    # ``device_type`` (the torch device type this platform's tensors carry); see
    # :func:`kvflow.platforms.op_dispatch_key`.
    name: str = "abstract"
    device_type: str = "abstract"
    default_attention_backend: str = "torch"
    # Token budget of an engine step when the user gives none (--max-num-batched-tokens).
    default_max_num_batched_tokens: int = 4096
    supports_graphs: bool = False
    # torch.distributed backend of the collectives between this platform's devices; a plugin
    # platform names its own (e.g. "hccl", "xccl").
    dist_backend: str = "gloo"

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

    def peak_memory(self) -> int:
        """Bytes allocated at the peak since ``reset_peak_memory`` (0 where unknown)."""
        return 0

    def peak_memory_reserved(self) -> int:
        """Bytes this process's allocator holds from the device now (0 where unknown)."""
        return 0

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return True

    def has_native_matmul(self, dtype: torch.dtype) -> bool:
        """Whether matmuls in ``dtype`` run on units built for it (else the engine widens
        16-bit GEMMs to fp32, see :mod:`kvflow.kernels.gemm`)."""
        return True

    def prepacks_gemm_weights(self, dtype: torch.dtype) -> bool:
        """Whether GEMM weights in ``dtype`` are packed once after loading
        (:func:`kvflow.kernels.gemm.prepack_gemm_weights`)."""
        return False
