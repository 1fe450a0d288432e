"""The runner's KV-cache set-up: the layers' specs, the memory budget (a GPU's measured by a
profiling forward pass), and the allocation of this rank's KV tensors bound to its layers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from kvflow.attention.layer import Attention
from kvflow.config import CacheConfig
from kvflow.kv_cache_interface import KVCacheConfig, KVCacheSpec, kv_cache_dtypes
from kvflow.platforms import Platform
from kvflow.platforms.cpu_memory import StepGate, prefault_in_background, zeros_on_huge_pages
from kvflow.spec_decode.draft_model import DraftModel

logger = logging.getLogger(__name__)


def kv_cache_spec(attn_layers: dict[str, Attention], drafter: DraftModel | None,
                  block_size: int, kv_cache_dtype: str,
                  dtype: torch.dtype) -> dict[str, KVCacheSpec]:
    """Each attention layer's KV-cache spec (layer name -> spec), in model order, with
    ``--kv-cache-dtype``'s element type (and scales for a quantized cache); ``dtype``: the
    model's compute dtype (what "auto" means)."""
    kv_dtype, scale_dtype = kv_cache_dtypes(kv_cache_dtype, dtype)
    specs = {name: layer.kv_cache_spec(block_size, kv_dtype, scale_dtype)
             for name, layer in attn_layers.items()}
    if drafter is not None:  # a draft model's layers, DRAFT_LAYER_PREFIX-named
        specs.update(drafter.kv_cache_spec(block_size, kv_dtype, scale_dtype))
    return specs


def check_fits(platform: Platform, kv_bytes: int) -> None:
    """Raises ValueError if the requested KV cache (``kv_bytes`` bytes) exceeds the device's
    free memory."""
    free, _ = platform.memory_info()
    if kv_bytes > free:
        raise ValueError(f"the KV cache needs {kv_bytes / 2**30:.2f} GiB but only "
                         f"{free / 2**30:.2f} GiB of {platform.name} memory is free; "
                         "lower --kv-cache-memory or --num-kv-blocks")


def check_kv_cache_config(kv_cache_config: KVCacheConfig, cache_config: CacheConfig,
                          platform: Platform, num_tensors: int, cp: int) -> None:
    """Check that this rank can hold ``kv_cache_config`` (``num_tensors`` local KV tensors,
    ``cp`` context-parallel ranks sharing each block).

    Raises:
        ValueError: if a cache sized by --num-kv-blocks or --kv-cache-memory would not fit
            in the device's free memory, or for a draft model beside several KV-cache
            groups (it reads group 0's block table).
    """
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    draft = kv_cache_config.draft_group
    if draft is not None and len(kv_cache_config.kv_cache_groups) > 1:
        raise ValueError("speculative_config method='draft_model' needs a target with one "
                         "KV-cache group (no sliding-window/full-attention mix)")
    if cache_config.num_kv_blocks is not None or cache_config.kv_cache_memory is not None:
        draft_bytes = draft.page_size_bytes if draft is not None else 0
        check_fits(platform, kv_cache_config.num_blocks * (
            spec.page_size_bytes * num_tensors // cp + draft_bytes))


def profile_kv_budget(platform: Platform, gpu_memory_utilization: float,
                      profile_run: Callable[[], None], num_tokens: int) -> int:
    """GPU: a forward pass at the full token budget (``profile_run``, ``num_tokens`` tokens:
    max_num_batched_tokens) measures peak activations; the KV cache gets
    gpu_memory_utilization x total memory minus the weights + activation peak and minus what
    other processes hold (bytes).

    Raises:
        ValueError: when that pass runs out of device memory (naming the token budget).
    """
    platform.reset_peak_memory()
    try:
        profile_run()
    except torch.OutOfMemoryError as exc:
        raise ValueError(
            f"the profiling step (one forward of max_num_batched_tokens={num_tokens} tokens) "
            f"ran out of {platform.name} memory beside the weights: lower "
            f"--max-num-batched-tokens, or use more GPUs or a quantized model ({exc})") from exc
    free, total = platform.memory_info()
    peak = platform.peak_memory()
    in_use_by_us = platform.peak_memory_reserved()
    used_by_others = max(total - free - in_use_by_us, 0)
    budget = int(total * gpu_memory_utilization) - peak - used_by_others
    logger.info("GPU memory: total %.1f GiB, peak during profiling %.2f GiB, used by others "
                "%.2f GiB, KV budget %.2f GiB", total / 2**30, peak / 2**30,
                used_by_others / 2**30, budget / 2**30)
    return budget


def local_kv_tensors(kv_cache_config: KVCacheConfig,
                     attn_layers: dict[str, Attention]) -> list[list[tuple[int, str]]]:
    """For each KV tensor ``j`` this rank allocates: the (group, layer name) pairs of its
    own layers (``attn_layers``) that use it. A pipeline stage skips tensors whose layers all
    live on other stages; without pipeline parallelism every tensor is local."""
    groups = kv_cache_config.kv_cache_groups
    users = [[(g, group.layer_names[j]) for g, group in enumerate(groups)
              if group.layer_names[j] in attn_layers]
             for j in range(kv_cache_config.num_tensors)]
    return [u for u in users if u]


def local_cache_shape(spec: KVCacheSpec, num_blocks: int, cp: int) -> tuple[int, ...]:
    """This rank's KV tensor shape: the spec's, except that under context parallelism
    (``cp`` ranks) each rank holds ``block_size / cp`` tokens of every block
    (``kvflow.attention.cp_paged``)."""
    shape = spec.kv_cache_shape(num_blocks)
    return shape if cp == 1 else (shape[0], shape[1], shape[2] // cp, *shape[3:])


def allocate_kv_caches(tensors: list[list[tuple[int, str]]], spec: KVCacheSpec,
                       num_blocks: int, attn_layers: dict[str, Attention],
                       device: torch.device, cp: int,
                       steps: StepGate | None = None
                       ) -> tuple[list[torch.Tensor], threading.Thread | None]:
    """One zeroed tensor (``local_cache_shape``, ``spec.dtype``) per entry of ``tensors``
    (``local_kv_tensors``), plus its float32 scales for a quantized cache, bound to the
    layers that use it (``layer.kv_cache``, ``kv_group``, ``kv_scales``). On the CPU the
    tensors sit on transparent huge pages (``platforms/cpu_memory.py``: a decode step reads
    blocks scattered over the whole cache), fresh zeroed mappings: each K and V plane's first
    2 MB page (the blocks handed out first) is backed now, the rest by a background thread
    while no step runs (``steps``; ``prefault_in_background``: the faults took seconds, on
    the way to ready). Returns the tensors in order and that thread (None: none started),
    which must be stopped (``cpu_memory.stop_prefault``) before the tensors are let go."""
    caches = []
    for users in tensors:
        shape = local_cache_shape(spec, num_blocks, cp)
        on_cpu = torch.device(device).type == "cpu"
        cache = zeros_on_huge_pages(shape, spec.dtype) if on_cpu else \
            torch.zeros(shape, dtype=spec.dtype, device=device)
        scales_shape = spec.kv_scales_shape(num_blocks)
        scales = None if scales_shape is None else \
            torch.zeros(scales_shape, dtype=spec.scale_dtype, device=device)
        for g, name in users:
            layer = attn_layers[name]
            layer.kv_cache, layer.kv_group = cache, g
            if scales is not None:
                layer.kv_scales = scales
        caches.append(cache)
    prefault = prefault_in_background(caches, gate=steps) \
        if torch.device(device).type == "cpu" else None
    return caches, prefault


def release_kv_cache(attn_layers: dict[str, Attention], drafter: DraftModel | None) -> None:
    """Unbind every layer's KV tensor (and scales), the draft model's too, so that they can
    be freed."""
    if drafter is not None:
        drafter.release_kv_cache()
    for layer in attn_layers.values():
        layer.kv_cache = torch.empty(0)
        if hasattr(layer, "kv_scales"):
            layer.kv_scales = None
