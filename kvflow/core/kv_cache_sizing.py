"""The engine's KV-cache configuration: the layers' specs grouped, the pool sized (from
``--num-kv-blocks`` or the executor's memory budget), the host pool of swap preemption, an
encoder's stand-in pool, and the positions a request may reach (the model's, and a sliding
window's cap under ``disable_sliding_window``)."""

from __future__ import annotations

from typing import Any

import torch

from kvflow.config import EngineConfig
from kvflow.core.kv_cache_utils import group_kv_cache_specs
from kvflow.executor import Executor
from kvflow.kv_cache_interface import (
    DRAFT_LAYER_PREFIX,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from kvflow.layers.rope_parameters import rope_max_positions, rope_positions_source
from kvflow.models.registry import position_offset
from kvflow.platforms.cpu import host_memory_bytes


def model_positions(hf_config: Any, config: EngineConfig, is_encoder: bool) -> int | None:
    """The positions the model's rotary tables cover (None: no such limit), an encoder's
    capped at one step's token budget (whole prompts per step).

    Raises:
        ValueError: if ``--max-model-len`` asks for more.
    """
    requested = config.model_config.max_model_len
    positions = rope_max_positions(hf_config) - position_offset(hf_config) \
        if hasattr(hf_config, "max_position_embeddings") else None
    if is_encoder:  # whole prompts per step: a prompt must fit one step's budget
        positions = min(positions or requested or 512,
                        config.scheduler_config.max_num_batched_tokens)
    if requested is not None and positions is not None and requested > positions:
        # The rotary tables hold this many positions (max_position_embeddings, as YaRN,
        # dynamic NTK or linear RoPE scaling stretch it): a longer sequence would index past
        # them mid-step.
        why = ("whole prompts per step: max_position_embeddings (less RoBERTa's "
               "padding_idx + 1), at most "
               "max_num_batched_tokens" if is_encoder else rope_positions_source(hf_config))
        raise ValueError(f"max_model_len={requested} exceeds the positions the model "
                         f"covers ({positions}: {why})")
    return positions


def make_kv_cache_config(executor: Executor, config: EngineConfig, is_encoder: bool,
                         dtype: torch.dtype) -> KVCacheConfig:
    """Group the layers' KV-cache specs and size the pool: --num-kv-blocks, else the bytes
    the executor reports divided by one block's bytes across all KV tensors (a draft
    model's layers included: its K/V of a block's tokens live under the same block id).

    Raises:
        ValueError: if fewer than 2 blocks fit (the null block plus one).
    """
    specs = executor.get_kv_cache_spec()
    if not specs and is_encoder:
        return encoder_kv_cache_config(config, dtype)
    draft = {n: s for n, s in specs.items() if n.startswith(DRAFT_LAYER_PREFIX)}
    groups = group_kv_cache_specs({n: s for n, s in specs.items() if n not in draft})
    draft_group = KVCacheGroupSpec(tuple(draft), next(iter(draft.values()))) \
        if draft else None
    num_blocks = config.cache_config.num_kv_blocks
    if num_blocks is None:
        page = KVCacheConfig(2, groups, draft_group).page_size_bytes
        budget = executor.determine_available_memory(groups)
        num_blocks = budget // page
        if num_blocks < 2:
            raise ValueError(_budget_refusal(config, budget, page))
    return KVCacheConfig(num_blocks, groups, draft_group,
                         num_host_blocks(config, KVCacheConfig(2, groups, draft_group)))


def _budget_refusal(config: EngineConfig, budget: int, page: int) -> str:
    """Why a budget of ``budget`` bytes (fewer than 2 blocks of ``page`` bytes) is refused,
    naming the setting it came from."""
    cc = config.cache_config
    blocks = max(budget // page, 0)
    if cc.kv_cache_memory is not None:
        return (f"kv_cache_memory={cc.kv_cache_memory!r} holds {blocks} KV-cache blocks of "
                f"{page} bytes (all layers); need at least 2: raise it, or set num_kv_blocks")
    return (f"the KV cache gets {budget / 2**30:.2f} GiB, {blocks} blocks of {page} bytes (all "
            "layers); need at least 2. On a GPU that budget is gpu_memory_utilization="
            f"{cc.gpu_memory_fraction} of its memory less the weights, the activation peak "
            "of a max_num_batched_tokens step and other processes' use: raise "
            "gpu_memory_utilization, lower max_num_batched_tokens, or set kv_cache_memory / "
            "num_kv_blocks")


def num_host_blocks(engine_config: EngineConfig, config: KVCacheConfig) -> int:
    """Blocks of --swap-space with --preemption-mode swap (0 otherwise): the host blocks one
    worker holds in ``--swap-space`` bytes. A context-parallel rank holds ``1 / cp`` of every
    block, so ``cp`` times the blocks fit; a pipeline stage holds only its own layers' share
    of ``config.page_size_bytes`` (all layers), so it uses less than ``--swap-space``.

    Raises:
        ValueError: for a --swap-space larger than the machine's memory or smaller than one
            block.
    """
    if engine_config.scheduler_config.preemption_mode != "swap":
        return 0
    cp = engine_config.parallel_config.context_parallel_size
    swap_space, size = engine_config.cache_config.swap_space_or_default, \
        engine_config.cache_config.swap_space_bytes
    total = host_memory_bytes()
    if size > total:  # more than lazily mapped pages could ever back
        raise ValueError(f"--swap-space {swap_space} (host memory per worker) exceeds this "
                         f"machine's {total / 2**30:.2f} GiB of memory; lower it")
    num = size * cp // config.page_size_bytes
    if num < 1:
        raise ValueError(f"--swap-space {swap_space} ({size} bytes) holds no KV block of "
                         f"{config.page_size_bytes // cp} bytes")
    return num


def encoder_kv_cache_config(config: EngineConfig, dtype: torch.dtype) -> KVCacheConfig:
    """An encoder keeps no KV cache (kvflow/attention/encoder.py), but its requests still
    go through the scheduler's block accounting: a group without layers (no tensor is
    allocated) with blocks enough for one step's whole prompts."""
    sc, bs = config.scheduler_config, config.cache_config.block_size
    spec = FullAttentionSpec(bs, 1, 1, dtype)
    num_blocks = -(-sc.max_num_batched_tokens // bs) + sc.max_num_seqs + 1
    return KVCacheConfig(num_blocks, (KVCacheGroupSpec((), spec),))


def model_len_refusal(config: EngineConfig, kv_config: KVCacheConfig, model_len: int,
                      capacity: int, fixed_kv_bytes: int | None) -> str:
    """Why an explicit ``max_model_len`` of ``model_len`` tokens is refused: one request of
    that length needs more blocks than the pool's usable ones (block 0 is the null block),
    which hold ``capacity`` tokens per request. vLLM's start-up check
    (``_check_enough_kv_cache_memory``): the KV memory needed vs available, the estimated
    maximum model length, and the settings to change (the one that sized the pool first;
    ``fixed_kv_bytes``: the platform's fixed default budget, None where
    ``gpu_memory_utilization`` sizes it).

    Args:
        config: the engine's configuration (the pool's sizing settings).
        kv_config: the sized pool.
        model_len: the ``max_model_len`` asked for (tokens).
        capacity: the longest request the pool holds (tokens), below ``model_len``.
    """
    cc, page = config.cache_config, kv_config.page_size_bytes
    step_tokens = config.scheduler_config.max_num_batched_tokens
    need = sum(g.kv_cache_spec.max_num_blocks(model_len, step_tokens)
               for g in kv_config.kv_cache_groups)
    usable = kv_config.num_blocks - 1
    if cc.num_kv_blocks is not None:
        fix = f"raise --num-kv-blocks (to at least {need + 1}: block 0 is the null block)"
    elif cc.kv_cache_memory is not None:
        fix = f"raise --kv-cache-memory (now {cc.kv_cache_memory!r})"
    elif fixed_kv_bytes is None:
        fix = (f"raise --gpu-memory-utilization (now {cc.gpu_memory_fraction}), or set "
               "--kv-cache-memory or --num-kv-blocks")
    else:
        fix = (f"set --kv-cache-memory (the KV cache is {_size(fixed_kv_bytes)} by default "
               "here) or --num-kv-blocks")
    return (f"max_model_len={model_len} does not fit the KV cache: one request of "
            f"{model_len} tokens needs {need} blocks of {kv_config.block_size} tokens "
            f"({_size(need * page)} of KV cache), more than the {usable} usable blocks "
            f"({_size(usable * page)}; block 0 is the null block), which hold {capacity} "
            f"tokens per request: the estimated maximum model length is {capacity}. "
            f"{fix[0].upper()}{fix[1:]}; or lower --max-model-len to {capacity} or less "
            "(or leave it unset, or -1, to cap it at what the KV cache holds)")


def _size(num_bytes: int) -> str:
    """``num_bytes`` for a message: GiB or MiB with two decimals, or plain bytes below 1 MiB."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.2f} MiB"
    return f"{num_bytes} bytes"


def window_capped(config: EngineConfig, kv_cache_config: KVCacheConfig,
                  wanted: int | None) -> int | None:
    """``wanted`` (the context asked for, tokens; None: no limit) capped at the model's
    sliding window under ``disable_sliding_window`` (vLLM's flag: a context within the
    window sees every key, so the sliding-window layers attend fully); unchanged without
    the flag or for a model without a sliding-window layer (ignored there, as in vLLM).

    Raises:
        ValueError: for a ``max_model_len`` above the window under the flag.
    """
    mc = config.model_config
    windows = [g.kv_cache_spec.sliding_window for g in kv_cache_config.kv_cache_groups
               if g.kv_cache_spec.sliding_window is not None]
    if not mc.disable_sliding_window or not windows:
        return wanted
    window = min(windows)
    if mc.max_model_len is not None and mc.max_model_len > window:
        raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's sliding "
                         f"window ({window} tokens), which disable_sliding_window caps "
                         "it at: lower it, or leave --disable-sliding-window out")
    return window if wanted is None else min(wanted, window)
