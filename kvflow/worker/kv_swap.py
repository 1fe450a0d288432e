"""Swap preemption, runner side: the host copy of the KV cache and the block copies.

``HostKVCache`` holds one host tensor per device tensor indexed by KV block ids, of the same
shape but with ``num_host_blocks`` blocks (pinned memory on CUDA; on CPU a second pool in
ordinary memory). Those tensors (``swapped_tensors``) are every attention layer's K/V, the
float32 scales beside them in a quantized cache (``--kv-cache-dtype int8|fp8_e4m3``: a
quantized block is meaningless without its scales), and a draft model's K/V and scales, which
live under the target's block ids: one host block id then holds all of them, as one device
block id does. Each step, before the forward pass writes any K/V, the runner applies the
scheduler's ``blocks_to_swap_out`` (device -> host) and then ``blocks_to_swap_in`` (host ->
device): one ``index_select`` + ``index_copy_`` per tensor and direction, along the block
dimension the KV-cache spec's shape says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from kvflow.attention.layer import Attention
from kvflow.kv_cache_interface import KVCacheSpec

# A device tensor indexed by block ids, and the dimension that indexes them.
BlockTensor = tuple[torch.Tensor, int]


def block_dim(shape_of: Callable[[int], tuple[int, ...] | None]) -> int:
    """The dimension that indexes blocks in the tensor ``shape_of(num_blocks)`` describes
    (``spec.kv_cache_shape``: [2, blocks, ...] -> 1, MLA's [blocks, ...] -> 0;
    ``spec.kv_scales_shape`` -> 1): where the shapes for 1 and 2 blocks differ."""
    one, two = shape_of(1), shape_of(2)
    return next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)


def swapped_tensors(layers: Iterable[Attention], spec: KVCacheSpec) -> list[BlockTensor]:
    """The tensors bound to ``layers`` (all sharing ``spec``) that a swap copies: each distinct
    ``kv_cache`` and, for a quantized cache, its ``kv_scales``, with their block dimensions
    (layers of several KV-cache groups share a tensor: listed once)."""
    kv_dim, out, seen = block_dim(spec.kv_cache_shape), [], set()
    scale_dim = None if spec.kv_scales_shape(1) is None else block_dim(spec.kv_scales_shape)
    for layer in layers:
        for tensor, dim in ((layer.kv_cache, kv_dim), (layer.kv_scales, scale_dim)):
            if tensor is not None and dim is not None and tensor.numel() and \
                    id(tensor) not in seen:
                seen.add(id(tensor))
                out.append((tensor, dim))
    return out


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


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor's uint8 view (same shape and memory); other tensors as they are."""
    return tensor.view(torch.uint8) if tensor.dtype.is_floating_point and \
        tensor.dtype.itemsize == 1 else tensor


class HostKVCache:
    """Host blocks mirroring the device tensors indexed by KV block ids.

    Args:
        device_tensors: (tensor, block dimension) pairs (``swapped_tensors``): the target's
            K/V (and scales), then a draft model's.
        num_host_blocks: blocks in the host pool (one id covers every tensor).
        pin_memory: page-lock the host tensors (CUDA).
    """

    def __init__(self, device_tensors: list[BlockTensor], num_host_blocks: int,
                 pin_memory: bool = False) -> None:
        self.device_tensors = device_tensors
        self.host_caches = []
        for tensor, dim in device_tensors:
            shape = list(tensor.shape)
            shape[dim] = num_host_blocks
            self.host_caches.append(zeroed_host_tensor(tuple(shape), tensor.dtype, pin_memory))
        # the copies move bytes: float8 has no CPU index_copy_, its uint8 view does
        self._dev = [(_as_bytes(t), dim) for t, dim in device_tensors]
        self._host = [_as_bytes(h) for h in self.host_caches]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks; ``pairs`` are (device id, host id)."""
        if not pairs:
            return
        dev = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        host = torch.tensor([h for _, h in pairs], dtype=torch.long)
        for (d_cache, dim), h_cache in zip(self._dev, self._host):
            blocks = d_cache.index_select(dim, dev.to(d_cache.device))
            h_cache.index_copy_(dim, host, blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks; ``pairs`` are (host id, device id)."""
        if not pairs:
            return
        host = torch.tensor([h for h, _ in pairs], dtype=torch.long)
        dev = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for (d_cache, dim), h_cache in zip(self._dev, self._host):
            blocks = h_cache.index_select(dim, host)
            d_cache.index_copy_(dim, dev.to(d_cache.device),
                                blocks.to(d_cache.device, non_blocking=True))
