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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvflow.kernels.attention_ref import paged_attention_ref  # noqa: F401 (re-export)

# Split-KV heuristics (see choose_num_splits).
SPLIT_MIN_SEQ_LEN = 512  # below this context length a single pass is already short
SPLIT_MIN_TOKENS = 256  # each split should cover at least this many keys
MAX_SPLITS = 16
DEFAULT_NUM_SMS = 132  # used off-GPU (interpreter); H100/H200 value

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest request index ``i`` with ``query_start_loc[i] // BLOCK_Q + i <= target``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "sliding_window"])
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, Hq, D] (NUM_SPLITS == 1)
    part_acc_ptr,  # fp32 [T, Hq, NUM_SPLITS, BLOCK_D] (NUM_SPLITS > 1)
    part_ml_ptr,  # fp32 [2, T, Hq, NUM_SPLITS]: running max (log2 domain) and sum
    k_scale_ptr,  # fp32 [num_blocks, block_size, Hkv] (QUANT_KV): per token and head
    v_scale_ptr,
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    seq_lens_ptr,  # int32 [num_seqs]
    block_table_ptr,  # int32 [num_seqs, max_blocks]
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_tokens,
    num_q_heads,
    sliding_window,  # keys in (p - sliding_window, p] are visible; used if USE_WINDOW
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_sb,
    stride_ss,
    QPKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT_KV: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens before this chunk (cached prefix)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_block * BLOCK_Q + offs_m // QPKV  # token index within the chunk
    head = kv_head * QPKV + offs_m % QPKV
    row_valid = (offs_m // QPKV < BLOCK_Q) & (q_idx < q_len)
    q_pos = ctx_len + q_idx  # absolute position of each row's token
    d_mask = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Keys this q-block can see: [kv_start, kv_end).
    kv_end = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    if USE_WINDOW:
        kv_start = tl.maximum(ctx_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    else:
        kv_start = 0
    tile_lo = kv_start // TILE_N
    tile_hi = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n
        k_valid = k_pos < kv_end
        phys_block = tl.load(block_table_row + k_pos // KV_BLOCK_SIZE, mask=k_valid, other=0)
        kv_off = (
            phys_block.to(tl.int64) * stride_kb
            + (k_pos % KV_BLOCK_SIZE) * stride_ks
            + kv_head * stride_kh
        )
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + offs_d[:, None],
            mask=k_valid[None, :] & d_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, TILE_N]
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + offs_d[None, :],
            mask=k_valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [TILE_N, BLOCK_D]
        if QUANT_KV:  # int8 / fp8 values times their per-token, per-head scales
            scale_off = (phys_block.to(tl.int64) * stride_sb
                         + (k_pos % KV_BLOCK_SIZE) * stride_ss + kv_head)
            k_scale = tl.load(k_scale_ptr + scale_off, mask=k_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_off, mask=k_valid, other=0.0)
            k = (k.to(tl.float32) * k_scale[None, :]).to(q.dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )
    else:
        part = (token * num_q_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(
            part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
        ml_plane = num_tokens * num_q_heads * NUM_SPLITS
        tl.store(part_ml_ptr + part, m_i, mask=row_valid)
        tl.store(part_ml_ptr + ml_plane + part, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_tokens,
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program (t, hb): log-sum-exp merge of the split partials of BLOCK_H heads of token t."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    hs_mask = (offs_h[:, None] < num_q_heads) & (offs_s[None, :] < NUM_SPLITS)
    part = (t * num_q_heads + offs_h[:, None]) * NUM_SPLITS + offs_s[None, :]  # [H, S]
    ml_plane = num_tokens * num_q_heads * NUM_SPLITS

    m = tl.load(part_ml_ptr + part, mask=hs_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + ml_plane + part, mask=hs_mask, other=0.0)
    m_max = tl.max(m, axis=1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max[:, None])  # [H, S]; 0 for empty splits (m = -inf)
    acc = tl.load(
        part_acc_ptr + part[:, :, None] * BLOCK_D + offs_d[None, None, :],
        mask=hs_mask[:, :, None],
        other=0.0,
    )  # [H, S, D]
    num = tl.sum(acc * w[:, :, None], axis=1)  # [H, D]
    den = tl.sum(l * w, axis=1)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        (num / den[:, None]).to(out_ptr.dtype.element_ty),
        mask=(offs_h[:, None] < num_q_heads) & (offs_d[None, :] < HEAD_DIM),
    )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def choose_num_splits(
    max_query_len: int, max_seq_len: int, num_reqs: int, num_kv_heads: int, num_sms: int
) -> int:
    """Pick the number of KV splits (1 = single-pass kernel).

    Rule: split only when the batch is all-decode (``max_query_len == 1``), the longest
    context is at least ``SPLIT_MIN_SEQ_LEN`` keys, and the single-pass grid
    (``num_reqs * num_kv_heads`` programs) would leave SMs idle (fewer programs than SMs).
    Then use enough splits for about two programs per SM, capped at ``MAX_SPLITS`` and at
    one split per ``SPLIT_MIN_TOKENS`` keys of the longest context.
    """
    work = num_reqs * num_kv_heads
    if max_query_len != 1 or max_seq_len < SPLIT_MIN_SEQ_LEN or work == 0 or work >= num_sms:
        return 1
    splits = min(
        MAX_SPLITS, math.ceil(2 * num_sms / work), math.ceil(max_seq_len / SPLIT_MIN_TOKENS)
    )
    return max(splits, 1)


def _launch_config(max_query_len: int, qpkv: int, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for the single/split-pass kernel."""
    if max_query_len * qpkv <= 16:  # decode-only or tiny chunks
        block_m = max(16, triton.next_power_of_2(qpkv))
    else:
        block_m = max(64, triton.next_power_of_2(qpkv))
    tile_n = 64 if block_d <= 128 else 32
    num_warps = 4 if block_m <= 64 else 8
    return block_m, tile_n, num_warps, 2


class PagedAttentionPlan(NamedTuple):
    """How one :func:`paged_attention` call is launched (:func:`plan_paged_attention`)."""

    qpkv: int  # query heads per KV head (GQA group size)
    block_d: int  # head_dim padded to a power of two, at least 16
    block_m: int  # rows per program: BLOCK_Q query tokens x QPKV heads, padded
    block_q: int  # query tokens per program
    tile_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int
    num_splits: int  # 1 = single pass; > 1 = split-KV partials plus the merge kernel
    grid: tuple[int, int, int]  # (q-blocks, KV heads, splits)


def plan_paged_attention(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, num_reqs: int,
    max_query_len: int, max_seq_len: int, num_sms: int, num_splits: int | None = None,
    batch_invariant: bool = False,
) -> PagedAttentionPlan:
    """Choose tile sizes, the split-KV path and the grid; pure arithmetic on the shapes.

    Tiles follow :func:`_launch_config` (``max_query_len`` picks decode-sized or prefill-sized
    row tiles). ``num_splits`` None applies :func:`choose_num_splits` with ``num_sms``;
    otherwise it is used as given. The grid has one program per q-block, KV head and split:
    ``num_tokens // BLOCK_Q + num_reqs`` q-blocks cover every request's blocks, partial last
    ones included, and surplus programs exit at once. So the grid depends only on token and
    request counts, never on lengths.

    ``batch_invariant`` (``--deterministic``): one launch configuration whatever the batch
    (decode-sized row tiles, one pass, ``num_splits`` ignored), so a query row always meets
    the same instructions over the same key tiles (aligned to absolute key positions; the
    extra fully masked tiles a longer q-block adds contribute exact zeros): its result then
    does not depend on the other requests or on where its chunk starts.
    """
    qpkv = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, tile_n, num_warps, num_stages = _launch_config(
        1 if batch_invariant else max_query_len, qpkv, block_d)
    block_q = block_m // qpkv
    if batch_invariant:
        num_splits = 1
    if num_splits is None:
        num_splits = choose_num_splits(max_query_len, max_seq_len, num_reqs, num_kv_heads,
                                       num_sms)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    return PagedAttentionPlan(qpkv, block_d, block_m, block_q, tile_n, num_warps, num_stages,
                              num_splits, grid)


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_table: torch.Tensor,
                  num_splits: int | None, kv_scales: torch.Tensor | None = None) -> None:
    """Raise ValueError on shapes, dtypes or ``num_splits`` that :func:`paged_attention`
    cannot take (see its Args)."""
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

    Returns:
        [T, num_heads, head_dim] in ``q.dtype`` (``out`` if given); padding rows are left
        unwritten (single pass) or unspecified (split path).

    Raises:
        ValueError: on inconsistent shapes/dtypes or a non-positive ``num_splits``.

    Correctness never depends on ``max_query_len``/``max_seq_len`` (they only pick tile
    shapes and the number of splits), so stale values, e.g. under CUDA-graph replay, are safe.
    """
    _check_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, num_splits, kv_scales)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a unit-stride last dim")
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    plan = plan_paged_attention(num_tokens, num_heads, kv_cache.shape[3], head_dim, num_reqs,
                                max_query_len, max_seq_len, _num_sms(q.device), num_splits,
                                batch_invariant)
    _launch(plan, q, kv_cache, query_start_loc, seq_lens, block_table, scale, sliding_window,
            out, kv_scales)
    return out


def _launch(plan: PagedAttentionPlan, q: torch.Tensor, kv_cache: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
            scale: float, sliding_window: int | None, out: torch.Tensor,
            kv_scales: torch.Tensor | None = None) -> None:
    """Run ``plan``: the attention kernel into ``out`` (single pass) or into fp32 partials
    (acc [T, heads, splits, BLOCK_D], m/l [2, T, heads, splits]) merged into ``out`` by
    :func:`_launch_merge`. Inputs are checked by :func:`paged_attention`."""
    num_tokens, num_heads, head_dim = q.shape
    if plan.num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, plan.num_splits, plan.block_d),
                               dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, num_tokens, num_heads, plan.num_splits),
                              dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused placeholders
    use_window = sliding_window is not None and sliding_window > 0
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scales = kv_scales if kv_scales is not None else kv_cache  # unused placeholder
    _paged_attention_kernel[plan.grid](
        q, k_cache, v_cache, out, part_acc, part_ml, scales[0], scales[1], query_start_loc,
        seq_lens, block_table,
        scale * _LOG2E, seq_lens.shape[0], num_tokens, num_heads,
        sliding_window if use_window else 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_table.stride(0), scales.stride(1), scales.stride(2),
        QPKV=plan.qpkv, HEAD_DIM=head_dim, KV_BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q, TILE_N=plan.tile_n, BLOCK_D=plan.block_d,
        NUM_SPLITS=plan.num_splits, USE_WINDOW=use_window,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        QUANT_KV=kv_scales is not None,
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
    _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out, part_acc, part_ml, num_tokens, num_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=plan.block_d, NUM_SPLITS=plan.num_splits,
        BLOCK_S=block_s, BLOCK_H=block_h, num_warps=4,
    )
