"""The CUDA platform: Triton kernels, bf16, CUDA graphs."""

from __future__ import annotations

import torch

from kvflow.platforms.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    default_attention_backend = "triton"
    supports_graphs = True
    dist_backend = "nccl"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def reset_peak_memory(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def peak_memory(self) -> int:
        return torch.cuda.max_memory_allocated()

    def peak_memory_reserved(self) -> int:
        return torch.cuda.memory_reserved()
