"""Paged attention on CPU over an int8 / float8-e4m3 KV cache (``--kv-cache-dtype int8|
fp8_e4m3``), read in place with its per-token, per-KV-head scales (``csrc/cpu_attention_kvq.c``;
the cache rule is :mod:`kvflow.kernels.kv_quant`).

Bound on the library :func:`kvflow.kernels.cpu_native.native_cpu_kernels` builds; the result
equals :func:`kvflow.kernels.paged_attention.paged_attention_ref` over the dequantized cache
(``q * scale`` per row) up to fp32 summation order.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels.cpu_native import NativeCpuKernels
from kvflow.kernels.cpu_native_attention import check_softcap

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CACHE_KINDS = {torch.int8: 0, torch.float8_e4m3fn: 1}


@functools.cache
def _entry(lib: ctypes.CDLL):
    fn = lib.kvflow_paged_attention_kvq
    fn.restype = _int
    fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64,
                   _i64, _i64, _i64, _f32, _i64, _f32, _int, _int, _int]
    return fn


def _check(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor,
           index_tensors: tuple[torch.Tensor, ...]) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, cache_dim = kv_cache.shape[3], kv_cache.shape[4]
    if q.dtype not in _DTYPE_CODES or kv_cache.dtype not in CACHE_KINDS:
        raise ValueError(f"quantized paged attention needs a float32/bfloat16/float16 q and an "
                         f"int8/float8_e4m3fn cache, got {q.dtype} and {kv_cache.dtype}")
    if any(t.device.type != "cpu" for t in (q, kv_cache, kv_scales, *index_tensors)):
        raise ValueError("quantized paged attention runs on CPU tensors only")
    if any(t.dtype != torch.int32 for t in index_tensors):
        raise ValueError("query_start_loc, seq_lens and block_table must be int32")
    if kv_scales.dtype != torch.float32 or kv_scales.shape != kv_cache.shape[:4] \
            or not kv_scales.is_contiguous():
        raise ValueError(f"kv_scales must be contiguous float32 {tuple(kv_cache.shape[:4])}, "
                         f"got {kv_scales.dtype} {tuple(kv_scales.shape)}")
    if not kv_cache.is_contiguous() or q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError("kv_cache must be contiguous and q contiguous over heads and head_dim")
    query_start_loc, seq_lens, block_table = index_tensors
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous()
            and block_table.stride(1) == 1):
        raise ValueError("query_start_loc, seq_lens and block_table rows must be contiguous")
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads of {head_dim}, the cache {num_kv_heads} of "
                         f"{cache_dim}: need equal head_dim and heads % kv_heads == 0")


def paged_attention_kvq(kernels: NativeCpuKernels, q: torch.Tensor, kv_cache: torch.Tensor,
                        kv_scales: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                        sliding_window: int | None = None, validate: bool = True,
                        softcap: float = 0.0) -> torch.Tensor:
    """Paged attention over a quantized cache read in place.

    Args:
        kernels: the built native kernels.
        q: [num_tokens, num_heads, head_dim], fp32/bf16/fp16, unit stride over heads and
            head_dim (any token stride).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] int8 or float8_e4m3fn,
            contiguous; kv_scales: float32 [2, num_blocks, block_size, num_kv_heads] (a row
            reads ``value * scale``).
        query_start_loc: int32 [num_reqs + 1]; seq_lens: int32 [num_reqs] (context after this
            step); block_table: int32 [num_reqs, max_blocks].
        scale: softmax scale; sliding_window: keys a query may look back (None = all).
        validate: check the indices first (the backend does so once per step).
        softcap: > 0 soft-caps the scores ``s`` to ``softcap * tanh(s / softcap)`` before the
            softmax (Gemma 2's ``attn_logit_softcapping``); 0 = off.

    Returns:
        [num_tokens, num_heads, head_dim] in q's dtype; rows past ``query_start_loc[-1]`` are
        unspecified.

    Raises:
        ValueError: on a dtype, device, layout or head-count mismatch, a negative or
            non-finite ``softcap``, or (validate) an index that would read outside q or the
            cache.
        MemoryError: when the kernel cannot allocate its per-thread scratch.
    """
    check_softcap(softcap)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    _check(q, kv_cache, kv_scales, (query_start_loc, seq_lens, block_table))
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 \
            or block_table.shape[0] < seq_lens.shape[0]:
        raise ValueError("query_start_loc needs num_reqs + 1 entries and block_table a row "
                         "per request")
    if validate:
        NativeCpuKernels.check_paged_indices(num_tokens, kv_cache, query_start_loc, seq_lens,
                                             block_table)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    status = _entry(kernels.lib)(
        q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        kv_scales[0].data_ptr(), kv_scales[1].data_ptr(), out.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), query_start_loc.data_ptr(),
        seq_lens.data_ptr(), seq_lens.shape[0], num_heads, num_kv_heads, head_dim, block_size,
        scale, sliding_window or 0, softcap, _DTYPE_CODES[q.dtype], CACHE_KINDS[kv_cache.dtype],
        torch.get_num_threads())
    if status:
        raise MemoryError("native quantized paged attention could not allocate its scratch")
    return out
