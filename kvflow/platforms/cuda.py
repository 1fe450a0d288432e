"""The CUDA platform: Triton kernels, bf16, CUDA graphs."""

from __future__ import annotations

import functools
import logging

import torch

from kvflow.platforms.base import Platform

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether the ``triton`` package imports (checked once per process; ``cache_clear()``
    checks again). Without it CUDA runs the torch attention backend and every custom op's
    plain-torch code (``forward_native``): every ``forward_cuda`` is a Triton kernel."""
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("the triton package is not importable: CUDA runs the torch attention "
                       "backend and plain-torch ops (pip install triton for kvflow's kernels)")
        return False
    return True


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` (FP8 tensor cores) runs on ``device``: compute capability
    8.9+ (Ada, Hopper) for a CUDA device; True elsewhere (torch's CPU ``_scaled_mm``)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device.index) >= (8, 9)


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    supports_graphs = True

    @property
    def default_attention_backend(self) -> str:
        """``triton`` (kvflow's kernels), or ``torch`` where triton is not installed."""
        return "triton" if triton_available() else "torch"
    dist_backend = "nccl"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def capability(self) -> tuple[int, int]:
        """The GPU's compute capability ``(major, minor)``, e.g. (9, 0) on an H100/H200."""
        return torch.cuda.get_device_capability(self.device)

    def default_dtype(self) -> torch.dtype:
        """bf16 where the GPU computes it natively (compute capability 8.0+), else fp16."""
        return torch.bfloat16 if self.supports_dtype(torch.bfloat16) else torch.float16

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """bf16 needs compute capability 8.0 (Ampere) or newer: on older GPUs torch only
        emulates it (``torch.cuda.is_bf16_supported()`` says True there) and Triton's dots
        cannot take it."""
        return dtype != torch.bfloat16 or self.capability() >= (8, 0)

    def check_dtype(self, dtype: torch.dtype, flag: str) -> None:
        """Raises ValueError naming ``flag`` when this GPU cannot compute in ``dtype``."""
        if not self.supports_dtype(dtype):
            major, minor = self.capability()
            raise ValueError(f"{flag} needs a GPU of compute capability 8.0 or newer (Ampere); "
                             f"{torch.cuda.get_device_name(self.device)} is {major}.{minor}: "
                             "use dtype='float16' (or 'auto')")

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak_memory(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def peak_memory(self) -> int:
        return torch.cuda.max_memory_allocated()

    def peak_memory_reserved(self) -> int:
        return torch.cuda.memory_reserved()

    def check_kv_cache_dtype(self, kv_cache_dtype: str, attention_backend: str) -> None:
        """An fp8_e4m3 cache with the Triton kernels needs compute capability 8.9+ (Ada,
        Hopper): Triton compiles no float8 e4m3 (``fp8e4nv``) code for older GPUs. The torch
        backend casts float8 on any GPU, and int8 runs everywhere.

        Raises:
            ValueError: naming kv_cache_dtype, the GPU and its capability.
        """
        if kv_cache_dtype != "fp8_e4m3" or attention_backend != "triton":
            return
        major, minor = self.capability()
        if (major, minor) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype='fp8_e4m3' needs a GPU of compute capability 8.9 or newer "
                f"(Ada, Hopper) for the Triton kernels; {torch.cuda.get_device_name(self.device)} "
                f"is {major}.{minor}: use kv_cache_dtype='int8', or attention_backend='torch'")
