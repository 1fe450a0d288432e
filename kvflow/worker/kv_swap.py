"""Swap preemption, runner side: the host copy of the KV cache and the block copies.

``HostKVCache`` holds one host tensor per device KV tensor, of the same shape but with
``num_host_blocks`` blocks (pinned memory on CUDA, so copies can overlap; on CPU a second
pool in ordinary memory). Each step, before the forward pass writes any K/V, the runner applies
the scheduler's ``blocks_to_swap_out`` (device -> host) and then ``blocks_to_swap_in`` (host ->
device): one ``index_select`` + ``index_copy_`` per tensor and direction, along the block
dimension the KV-cache spec's shape says.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvflow.kv_cache_interface import KVCacheSpec


def block_dim(spec: KVCacheSpec) -> int:
    """The dimension of ``spec``'s KV tensor that indexes blocks ([2, blocks, ...] -> 1,
    MLA's [blocks, ...] -> 0): where the shapes for 1 and 2 blocks differ."""
    one, two = spec.kv_cache_shape(1), spec.kv_cache_shape(2)
    return next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype,
                       pin_memory: bool) -> torch.Tensor:
    """A zero-filled host tensor of ``shape`` and ``dtype``. Unpinned, its memory comes from
    ``calloc`` (numpy's ``zeros``), which maps the OS's zero pages: only the pages later
    written take memory, so a ``--swap-space 4GiB`` pool that swaps little costs little
    (``torch.zeros`` writes, so commits, every byte: 4 GiB and seconds at start-up on CPU).
    Pinned memory (CUDA) is page-locked anyway and comes from ``torch.zeros``."""
    if pin_memory:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class HostKVCache:
    """Host blocks mirroring the device KV tensors.

    Args:
        device_caches: the runner's KV tensors (one per layer slot).
        spec: their KV-cache spec (shape and dtype).
        num_host_blocks: blocks in the host pool.
        pin_memory: page-lock the host tensors (CUDA).
    """

    def __init__(self, device_caches: list[torch.Tensor], spec: KVCacheSpec,
                 num_host_blocks: int, pin_memory: bool = False) -> None:
        self.device_caches = device_caches
        self.dim = block_dim(spec)
        self.host_caches = [zeroed_host_tensor(spec.kv_cache_shape(num_host_blocks), spec.dtype,
                                               pin_memory)
                            for _ in device_caches]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks; ``pairs`` are (device id, host id)."""
        if not pairs:
            return
        dev = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        host = torch.tensor([h for _, h in pairs], dtype=torch.long)
        for d_cache, h_cache in zip(self.device_caches, self.host_caches):
            blocks = d_cache.index_select(self.dim, dev.to(d_cache.device))
            h_cache.index_copy_(self.dim, host, blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks; ``pairs`` are (host id, device id)."""
        if not pairs:
            return
        host = torch.tensor([h for h, _ in pairs], dtype=torch.long)
        dev = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for d_cache, h_cache in zip(self.device_caches, self.host_caches):
            blocks = h_cache.index_select(self.dim, host)
            d_cache.index_copy_(self.dim, dev.to(d_cache.device),
                                blocks.to(d_cache.device, non_blocking=True))
