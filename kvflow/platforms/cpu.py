"""The CPU platform: torch reference kernels, bf16 when the CPU has native bf16 matmuls."""

from __future__ import annotations

import os

import torch

from kvflow.platforms.base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    default_attention_backend = "torch"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        native_bf16 = torch.backends.mkldnn.is_available() and \
            torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if native_bf16 else torch.float32

    def memory_info(self) -> tuple[int, int]:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return avail, pages
