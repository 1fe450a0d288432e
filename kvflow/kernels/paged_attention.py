"""Paged attention for a mixed batch of prefill chunks and decodes, in one Triton launch.

Algorithm
---------
* Single pass ("unified") kernel: FlashAttention-2 style tiling with an online softmax in fp32
  (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
  2023, Algorithm 1).  Program ``(qb, g)`` owns one block of ``BLOCK_Q`` consecutive query
  tokens of one request times the ``QPKV = num_heads // num_kv_heads`` query heads that share
  KV head ``g`` (GQA), flattened into ``BLOCK_M = BLOCK_Q * QPKV`` (padded) rows, so every K/V
  tile is loaded once for the whole head group.  K/V are gathered tile by tile (``TILE_N``
  keys; each key looks its physical block up in ``block_table``, so ``TILE_N`` and the cache
  ``block_size`` are independent), and ``S = Q K^T`` and ``O += P V`` use ``tl.dot`` with
  fp32 accumulation.  Causality skips key tiles past the q-block's last query, and the
  sliding window skips tiles before its first visible key.
  The request that owns global q-block ``qb`` is found in-kernel by a binary search over
  ``query_start_loc`` (request ``i`` owns q-blocks starting at ``query_start_loc[i] // BLOCK_Q
  + i``), so the launch needs no host sync and the grid depends only on ``num_tokens`` and
  ``num_reqs``.
* Split-KV ("flash-decoding") path: the same kernel with ``NUM_SPLITS > 1`` partitions each
  program's key range into ``NUM_SPLITS`` contiguous tile ranges along a third grid axis and
  writes un-normalised partial results (acc, running max ``m``, running sum ``l``) in fp32;
  a second kernel merges them with the log-sum-exp rule (Dao et al., "Flash-Decoding for
  long-context inference", 2023).  It is correct for any batch, and is chosen automatically
  only for all-decode batches (see :func:`choose_num_splits`).

Quantized cache: with ``kv_scales`` (int8 / float8_e4m3fn cache, one float32 scale per token
and KV head, :mod:`kvflow.kernels.kv_quant`) each loaded K/V tile is multiplied by its scales
in fp32 and cast to the query dtype before the dots (``QUANT_KV``).

Positions: query token ``j`` of request ``i`` (``0 <= j < q_len_i``) sits at position
``seq_lens[i] - q_len_i + j`` and sees keys ``0..p`` (or, with ``sliding_window=W``, keys in
``(p - W, p]``).
"""

from __future__ import annotations

import math

import torch
import triton

from kvflow.kernels.attention_ref import paged_attention_ref  # noqa: F401 (re-export)
from kvflow.kernels.paged_attention_kernels import (
    LOG2E,
    merge_splits_kernel,
    paged_attention_kernel,
)
from kvflow.kernels.paged_attention_plan import (  # noqa: F401 (re-exports)
    MAX_SPLITS,
    PagedAttentionPlan,
    choose_num_splits,
    num_sms_of,
    plan_paged_attention,
)


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_table: torch.Tensor,
                  num_splits: int | None, kv_scales: torch.Tensor | None = None,
                  softcap: float = 0.0) -> None:
    """Raise ValueError on shapes, dtypes, ``num_splits`` or ``softcap`` that
    :func:`paged_attention` cannot take (see its Args)."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}")
    _, num_heads, head_dim = q.shape
    num_kv_heads, cache_head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q heads/dim ({num_heads}, {head_dim}) incompatible with cache "
            f"({num_kv_heads}, {cache_head_dim})"
        )
    if kv_scales is not None:
        if kv_cache.dtype not in (torch.int8, torch.float8_e4m3fn) or \
                kv_scales.shape != kv_cache.shape[:4] or kv_scales.dtype != torch.float32:
            raise ValueError(f"a quantized cache is int8/float8_e4m3fn with float32 kv_scales "
                             f"{tuple(kv_cache.shape[:4])}; got {kv_cache.dtype} and "
                             f"{kv_scales.dtype} {tuple(kv_scales.shape)}")
    elif q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] < num_reqs:
        raise ValueError("query_start_loc must be [num_reqs + 1] and block_table [num_reqs, *]")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must have a unit-stride last dim")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no soft-capping), "
                         f"got {softcap!r}")


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
    batch_invariant: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal paged attention over a mixed prefill/decode batch.

    Checks the inputs, chooses the launch (:func:`plan_paged_attention`) and launches it
    (:func:`_launch`).

    Args:
        q: [T, num_heads, head_dim], fp16/bf16/fp32; last dim unit-stride (token/head strides
            are free, so a view into a fused QKV output works).  Rows beyond
            ``query_start_loc[-1]`` are padding.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], same dtype as ``q``,
            last dim unit-stride; ``num_heads % num_kv_heads == 0``.
        query_start_loc: int32 [num_reqs + 1], cumulative query lengths (tokens).
        seq_lens: int32 [num_reqs], context length of each request including this chunk.
        block_table: int32 [num_reqs, max_blocks], last dim unit-stride.
        max_query_len: longest query chunk (tokens); selects tile shapes and the split path.
        max_seq_len: longest context (tokens); only used by the split heuristic.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: if set (> 0), position ``p`` sees keys in ``(p - sliding_window, p]``.
        out: optional preallocated [T, num_heads, head_dim] output (last dim unit-stride).
        num_splits: ``None`` = automatic (:func:`choose_num_splits`); ``1`` forces the
            single-pass kernel; ``> 1`` forces the split-KV path with that many splits.
        kv_scales: float32 [2, num_blocks, block_size, num_kv_heads] when ``kv_cache`` is
            quantized (int8 / float8_e4m3fn): each key/value row is read as its values times
            its scale (:mod:`kvflow.kernels.kv_quant`), then used in ``q.dtype``.
        batch_invariant: one launch configuration for every batch (see
            :func:`plan_paged_attention`), as ``--deterministic`` needs.
        softcap: > 0 soft-caps the scores ``x = q.k * scale`` to ``softcap * tanh(x /
            softcap)`` before the mask and softmax (Gemma 2's ``attn_logit_softcapping``;
            Gemma 2 report, sec. 2); 0 = off.

    Returns:
        [T, num_heads, head_dim] in ``q.dtype`` (``out`` if given); padding rows are left
        unwritten (single pass) or unspecified (split path).

    Raises:
        ValueError: on inconsistent shapes/dtypes, a non-positive ``num_splits`` or a
            negative or non-finite ``softcap``.

    Correctness never depends on ``max_query_len``/``max_seq_len`` (they only pick tile
    shapes and the number of splits), so stale values, e.g. under CUDA-graph replay, are safe.
    """
    _check_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, num_splits, kv_scales,
                  softcap)
    q, block_table, out = _unit_stride_operands(q, block_table, out)
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    plan = plan_paged_attention(num_tokens, num_heads, kv_cache.shape[3], head_dim, num_reqs,
                                max_query_len, max_seq_len, num_sms_of(q.device), num_splits,
                                batch_invariant, q.element_size())
    _launch(plan, q, kv_cache, query_start_loc, seq_lens, block_table, scale, sliding_window,
            out, kv_scales, softcap)
    return out


def _unit_stride_operands(q: torch.Tensor, block_table: torch.Tensor,
                          out: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q`` and ``block_table`` with a unit-stride last dim (copied if not) and the output
    (``out``, checked, or a new contiguous tensor like ``q``).

    Raises:
        ValueError: if ``out`` is not shaped like ``q`` or its last dim is strided.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a unit-stride last dim")
    return q, block_table, out


def _split_partials(plan: PagedAttentionPlan, q: torch.Tensor,
                    out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV path's fp32 partials: acc [T, heads, splits, BLOCK_D] and m/l
    [2, T, heads, splits]; for a single pass ``out`` twice (unused placeholders)."""
    if plan.num_splits <= 1:
        return out, out
    num_tokens, num_heads, _ = q.shape
    part_acc = torch.empty((num_tokens, num_heads, plan.num_splits, plan.block_d),
                           dtype=torch.float32, device=q.device)
    part_ml = torch.empty((2, num_tokens, num_heads, plan.num_splits),
                          dtype=torch.float32, device=q.device)
    return part_acc, part_ml


def _launch(plan: PagedAttentionPlan, q: torch.Tensor, kv_cache: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
            scale: float, sliding_window: int | None, out: torch.Tensor,
            kv_scales: torch.Tensor | None = None, softcap: float = 0.0) -> None:
    """Run ``plan``: the attention kernel into ``out`` (single pass) or into fp32 partials
    (acc [T, heads, splits, BLOCK_D], m/l [2, T, heads, splits]) merged into ``out`` by
    :func:`_launch_merge`. Inputs are checked by :func:`paged_attention`."""
    num_tokens, num_heads, head_dim = q.shape
    part_acc, part_ml = _split_partials(plan, q, out)
    use_window = sliding_window is not None and sliding_window > 0
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scales = kv_scales if kv_scales is not None else kv_cache  # unused placeholder
    paged_attention_kernel[plan.grid](
        q, k_cache, v_cache, out, part_acc, part_ml, scales[0], scales[1], query_start_loc,
        seq_lens, block_table,
        scale * LOG2E, seq_lens.shape[0], num_tokens, num_heads,
        sliding_window if use_window else 0, softcap * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_table.stride(0), scales.stride(1), scales.stride(2),
        QPKV=plan.qpkv, HEAD_DIM=head_dim, KV_BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q, TILE_N=plan.tile_n, BLOCK_D=plan.block_d,
        NUM_SPLITS=plan.num_splits, USE_WINDOW=use_window,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        QUANT_KV=kv_scales is not None, SOFTCAP=softcap > 0,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if plan.num_splits > 1:
        _launch_merge(plan, out, part_acc, part_ml, head_dim)


def _launch_merge(plan: PagedAttentionPlan, out: torch.Tensor, part_acc: torch.Tensor,
                  part_ml: torch.Tensor, head_dim: int) -> None:
    """Merge the split-KV partials into ``out`` by the log-sum-exp rule: one program per token
    and block of ``BLOCK_H`` heads, sized so a program holds at most 4096 partial values."""
    num_tokens, num_heads = out.shape[0], out.shape[1]
    block_s = triton.next_power_of_2(plan.num_splits)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // (block_s * plan.block_d)))
    merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out, part_acc, part_ml, num_tokens, num_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=plan.block_d, NUM_SPLITS=plan.num_splits,
        BLOCK_S=block_s, BLOCK_H=block_h, num_warps=4,
    )
