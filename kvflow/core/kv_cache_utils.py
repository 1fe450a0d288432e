"""KV-cache groups from per-layer specs, and how long a request the pool can hold.

Grouping rule (the one place it is written): full-attention layers form group 0; the
sliding-window layers are cut into further groups of the same size (Gemma 3's 5 local : 1
global gives 1 + 5 groups). Every group then needs the same KV tensors, so layer ``j`` of each
group shares tensor ``j`` and a block id is owned by one group at a time; a sliding group holds
only the blocks inside its window. When every layer has the same span there is one group of
that span (a window still frees blocks: Mistral). When windows differ or the counts do not
divide there is one full-attention group: no savings, and each layer's mask keeps it exact.
"""

from __future__ import annotations

from kvflow.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
)


def group_kv_cache_specs(layer_specs: dict[str, KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Split attention layers into KV-cache groups of equal size by attention span.

    Args:
        layer_specs: attention layer name -> its spec, in model order.

    Returns:
        The groups, full attention first.

    Raises:
        ValueError: if there are no attention layers, or the layers differ in block shape
            (tensor shape per block, dtype, scale dtype): they could not share KV tensors.
    """
    if not layer_specs:
        raise ValueError("the model has no attention layers")
    shapes = {(s.kv_cache_shape(1), s.dtype, s.scale_dtype) for s in layer_specs.values()}
    if len(shapes) > 1:
        raise ValueError(f"attention layers differ in KV block shape {sorted(map(str, shapes))}; "
                         "kvflow needs one shape (block_size, kv heads, head size, dtype)")
    full = [n for n, s in layer_specs.items() if s.sliding_window is None]
    local = [n for n, s in layer_specs.items() if s.sliding_window is not None]
    windows = {layer_specs[n].sliding_window for n in local}
    first = next(iter(layer_specs.values()))
    if not full or not local:  # one span for every layer
        return (KVCacheGroupSpec(tuple(layer_specs), first),)
    if len(windows) > 1 or len(local) % len(full):
        plain = FullAttentionSpec(first.block_size, first.num_kv_heads, first.head_size,
                                  first.dtype, first.scale_dtype)
        return (KVCacheGroupSpec(tuple(layer_specs), plain),)
    n = len(full)
    return (KVCacheGroupSpec(tuple(full), layer_specs[full[0]]),
            *(KVCacheGroupSpec(tuple(local[i:i + n]), layer_specs[local[0]])
              for i in range(0, len(local), n)))


def max_tokens_per_request(config: KVCacheConfig, max_num_batched_tokens: int,
                           limit: int = 0) -> int:
    """Longest sequence (tokens) whose blocks fit the pool alone: every full-attention group
    holds all its blocks, a sliding-window group at most its window plus one step's chunk.
    With only sliding-window groups a request's blocks stop growing at that bound, so a pool
    holding it holds a sequence of any length: the answer is then at least ``limit``.

    Args:
        config: the sized pool (block 0 is the null block and never handed out).
        max_num_batched_tokens: the scheduler's token budget per step.
        limit: the longest sequence asked for (the model's context; 0: none), the search's
            upper end where the pool's own token count is lower.
    """
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    usable = config.num_blocks - 1

    def need(num_tokens: int) -> int:
        return sum(s.max_num_blocks(num_tokens, max_num_batched_tokens) for s in specs)

    # need(lo) <= usable, and need(hi + 1) > usable or hi is the search's end
    lo, hi = 0, max(usable * config.block_size, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= usable else (lo, mid - 1)
    return lo


def max_concurrency(config: KVCacheConfig, max_num_batched_tokens: int,
                    max_model_len: int) -> float:
    """Requests of ``max_model_len`` tokens the pool holds at once: usable blocks over the
    blocks one such request holds (every full-attention group all of its blocks, a
    sliding-window group at most its window plus one step's chunk), as vLLM's "maximum
    concurrency" at start-up. Fractional (1.5: one request, and half of another).

    Args:
        config: the sized pool (block 0 is the null block and never handed out).
        max_num_batched_tokens: the scheduler's token budget per step.
        max_model_len: tokens of one request (>= 1).
    """
    need = sum(g.kv_cache_spec.max_num_blocks(max_model_len, max_num_batched_tokens)
               for g in config.kv_cache_groups)
    return (config.num_blocks - 1) / need


def kv_bytes_per_token(config: KVCacheConfig) -> int:
    """KV-cache bytes one token occupies: one slot of a block in every group's layers (with a
    quantized cache's scales, as the specs count them), and in a draft model's layers."""
    draft = config.draft_group.page_size_bytes if config.draft_group is not None else 0
    return (sum(g.page_size_bytes for g in config.kv_cache_groups) + draft) // config.block_size
