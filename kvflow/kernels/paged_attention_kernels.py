"""The Triton kernels of :func:`kvflow.kernels.paged_attention.paged_attention`: the single
pass / split-KV attention kernel and the merge of split-KV partials. The algorithm (its
sources, tiling, the in-kernel request search) is described in that module's docstring; the
launch parameters come from :mod:`kvflow.kernels.paged_attention_plan`.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


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


@triton.jit
def _kv_tiles(ctx_len, q_len, q_block, split, sliding_window, BLOCK_Q: tl.constexpr,
              TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr):
    """The keys a q-block can see, ``[kv_start, kv_end)``: returns ``kv_end`` and this
    split's tiles ``[tile_lo, tile_hi)`` of ``TILE_N`` keys."""
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
    return kv_end, tile_lo, tile_hi


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, k_pos,
                  k_valid, kv_head, offs_d, d_mask, stride_kb, stride_ks, stride_kh,
                  stride_sb, stride_ss, COMPUTE_DTYPE: tl.constexpr,
                  KV_BLOCK_SIZE: tl.constexpr, QUANT_KV: tl.constexpr):
    """The K tile ``[BLOCK_D, TILE_N]`` and V tile ``[TILE_N, BLOCK_D]`` of the keys at
    ``k_pos`` (through the request's block table row; invalid keys read as 0), a quantized
    cache's values dequantized to ``COMPUTE_DTYPE``."""
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
        k = (k.to(tl.float32) * k_scale[None, :]).to(COMPUTE_DTYPE)
        v = (v.to(tl.float32) * v_scale[:, None]).to(COMPUTE_DTYPE)
    return k, v


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax (log2 domain): fold the masked scores ``s``
    ``[BLOCK_M, TILE_N]`` and values ``v`` into the running max ``m_i``, sum ``l_i`` and
    fp32 accumulator ``acc``; returns the three updated."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_output(out_ptr, acc, l_i, token, head, offs_d, row_valid, d_mask, stride_ot,
                  stride_oh):
    """A single-pass kernel's result: ``acc / l_i`` (rows with no visible key: 0) into the
    output rows, in the output's dtype."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


@triton.jit
def _store_partials(part_acc_ptr, part_ml_ptr, acc, m_i, l_i, token, head, split, offs_d,
                    row_valid, num_tokens, num_q_heads, BLOCK_D: tl.constexpr,
                    NUM_SPLITS: tl.constexpr):
    """A split's partial result for ``merge_splits_kernel``: its fp32 accumulator and its
    running max and sum."""
    part = (token * num_q_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
    tl.store(
        part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
        acc,
        mask=row_valid[:, None],
    )
    ml_plane = num_tokens * num_q_heads * NUM_SPLITS
    tl.store(part_ml_ptr + part, m_i, mask=row_valid)
    tl.store(part_ml_ptr + ml_plane + part, l_i, mask=row_valid)


@triton.jit
def _locate_q_block(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """The request owning global q-block ``q_block_global`` (binary search, see the module
    docstring of ``paged_attention``): ``(seq, q_start, q_len, q_block)``, its first token,
    its query length and the q-block's index within it."""
    seq = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    return seq, q_start, q_len, q_block


@triton.jit
def _q_rows(q_start, q_len, q_block, ctx_len, kv_head, QPKV: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The program's ``BLOCK_M`` rows (BLOCK_Q tokens x the QPKV heads of ``kv_head``):
    ``(token, head, q_pos, row_valid)``, the int64 token index, query head, absolute
    position and whether the row is real (not padding)."""
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // QPKV  # token index within the chunk
    head = kv_head * QPKV + offs_m % QPKV
    row_valid = (offs_m // QPKV < BLOCK_Q) & (q_idx < q_len)
    q_pos = ctx_len + q_idx  # absolute position of each row's token
    token = (q_start + q_idx).to(tl.int64)
    return token, head, q_pos, row_valid


@triton.jit
def _masked_scores(q, k, k_pos, k_valid, q_pos, qk_scale, sliding_window, softcap_log2,
                   USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   SOFTCAP: tl.constexpr):
    """Scores ``q k * qk_scale`` [BLOCK_M, TILE_N] (log2 domain), soft-capped with SOFTCAP,
    -inf where a key is past its row's position, invalid, or outside the sliding window.

    Soft-capping (Gemma 2's ``cap * tanh(x / cap)`` of the natural-log score ``x``) in the
    log2 domain: with ``s = x * log2(e)`` and ``C = cap * log2(e)`` (``softcap_log2``) the
    capped score is ``C * tanh(s / C)``; tanh as ``2 sigmoid(2y) - 1`` (Triton has no tanh
    on every target), saturating to +-1 without overflow."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
    if SOFTCAP:
        s = softcap_log2 * (2.0 * tl.sigmoid(2.0 * s / softcap_log2) - 1.0)
    visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
    if USE_WINDOW:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < sliding_window)
    return tl.where(visible, s, float("-inf"))


# Arguments that change from step to step are not specialized (a value of 1 or a multiple of
# 16 would compile a variant of its own, mid-run): the counts, the window, the cap and the
# block table's width (``stride_bt``: the longest context's blocks in an eager step).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "sliding_window", "softcap_log2",
                               "stride_bt"])
def paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D] each
    out_ptr,  # [T, Hq, D] (NUM_SPLITS == 1)
    part_acc_ptr,  # fp32 [T, Hq, NUM_SPLITS, BLOCK_D] (NUM_SPLITS > 1)
    part_ml_ptr,  # fp32 [2, T, Hq, NUM_SPLITS]: running max (log2 domain) and sum
    k_scale_ptr, v_scale_ptr,  # fp32 [num_blocks, block_size, Hkv] (QUANT_KV): per token, head
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    seq_lens_ptr,  # int32 [num_seqs]
    block_table_ptr,  # int32 [num_seqs, max_blocks]
    qk_scale,  # softmax scale * log2(e)
    num_seqs, num_tokens, num_q_heads,
    sliding_window,  # keys in (p - sliding_window, p] are visible; used if USE_WINDOW
    softcap_log2,  # attention-logit soft cap * log2(e); used if SOFTCAP
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    stride_sb, stride_ss,
    QPKV: tl.constexpr, HEAD_DIM: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANT_KV: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Program (q-block, KV head, split): attention of one q-block's rows over its visible
    keys, tile by tile with an online softmax; the output (one split) or fp32 partials."""
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, q_block = _locate_q_block(query_start_loc_ptr, tl.program_id(0),
                                                   num_seqs, BLOCK_Q)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens before this chunk (cached prefix)
    token, head, q_pos, row_valid = _q_rows(q_start, q_len, q_block, ctx_len, kv_head, QPKV,
                                            BLOCK_M, BLOCK_Q)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    kv_end, tile_lo, tile_hi = _kv_tiles(ctx_len, q_len, q_block, split, sliding_window,
                                         BLOCK_Q, TILE_N, NUM_SPLITS, USE_WINDOW)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n
        k_valid = k_pos < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                             block_table_row, k_pos, k_valid, kv_head, offs_d, d_mask,
                             stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, q.dtype,
                             KV_BLOCK_SIZE, QUANT_KV)
        s = _masked_scores(q, k, k_pos, k_valid, q_pos, qk_scale, sliding_window, softcap_log2,
                           USE_WINDOW, DOT_PRECISION, SOFTCAP)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    if NUM_SPLITS == 1:
        _store_output(out_ptr, acc, l_i, token, head, offs_d, row_valid, d_mask, stride_ot,
                      stride_oh)
    else:
        _store_partials(part_acc_ptr, part_ml_ptr, acc, m_i, l_i, token, head, split, offs_d,
                        row_valid, num_tokens, num_q_heads, BLOCK_D, NUM_SPLITS)


@triton.jit(do_not_specialize=["num_tokens"])
def merge_splits_kernel(
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
