"""Python wrappers of the native paged-attention kernels (``csrc/cpu_attention*.c``): argument
checks, then one ctypes call. A mixin of :class:`kvflow.kernels.cpu_native.NativeCpuKernels`
(the quantized-cache attention is bound separately, :mod:`kvflow.kernels.cpu_attention_kvq`).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from kvflow.kernels.cpu_native_common import DTYPE_CODES, bind, c_int, f32, i64, ptr, raise_on


class AttentionKernels:
    """Paged attention over the cache read in place, and the K/V store into it."""

    def _bind_attention(self, lib: ctypes.CDLL) -> None:
        self._attn = bind(lib, "kvflow_paged_attention", c_int,
                          [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                           f32, i64, f32, c_int, c_int, c_int])
        self._store_kv = bind(lib, "kvflow_store_kv", c_int,
                              [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, c_int, c_int])

    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float,
                        sliding_window: int | None = None, validate: bool = True,
                        tiled: bool = True, bf16_dot: bool = True,
                        batch_invariant: bool = False, softcap: float = 0.0) -> torch.Tensor:
        """Paged attention over ``kv_cache`` read in place (same contract as
        :func:`kvflow.kernels.paged_attention.paged_attention_ref`).

        Args:
            q: [num_tokens, num_heads, head_dim], fp32/bf16/fp16, unit stride over heads and
                head_dim (any token stride).
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous, q's dtype.
            query_start_loc: int32 [num_reqs + 1]; seq_lens: int32 [num_reqs];
            block_table: int32 [num_reqs, max_blocks], unit stride over blocks.
            scale: softmax scale; sliding_window: keys a query may look back (None = all).
            validate: check the indices (:meth:`check_paged_indices`) first; pass False only
                when the caller has (the attention backend checks once per step, not per layer).
            tiled: multi-token queries (prefill) go through the register-tiled path where
                head_dim % 16 == 0; False forces the row-by-row path (for comparisons).
            bf16_dot: with ``tiled``, a bf16 cache on a CPU with AVX512-BF16 (the
                ``avx512_bf16`` build) multiplies both products of a prefill tile by bf16 dot
                products (VDPBF16PS), the softmax weights rounded to bf16 (each output moves
                by at most 2^-9 of the largest value row it mixes); False keeps the widening
                fp32 path (for comparisons). Other dtypes and builds ignore it.
            batch_invariant: attend every query token alone by the decode path (overrides
                ``tiled``): a token's output is then bitwise the same whatever the other
                tokens of the call (its chunk, other requests), as ``--deterministic`` needs.
            softcap: > 0 soft-caps the scores ``s = q.k * scale`` to ``softcap *
                tanh(s / softcap)`` before the mask and softmax (Gemma 2's
                ``attn_logit_softcapping``); 0 = off. Every path caps (the tiled and bf16-dot
                prefill tiles and the vector and bf16 decode paths too), in every ISA build.

        Returns:
            [num_tokens, num_heads, head_dim] in q's dtype; rows past
            ``query_start_loc[-1]`` (padding) are unspecified.

        Raises:
            ValueError: on a dtype, device, layout or head-count mismatch, a negative or
                non-finite ``softcap``, or (validate) an index that would read outside q or
                the cache.
            MemoryError: when the kernel cannot allocate its per-thread scratch.
        """
        check_softcap(softcap)
        num_tokens, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
        self._check(q, kv_cache, query_start_loc, seq_lens, block_table, num_heads,
                    num_kv_heads, head_dim, cache_dim)
        if validate:
            self.check_paged_indices(num_tokens, kv_cache, query_start_loc, seq_lens, block_table)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
        args = (q.data_ptr(), q.stride(0), *cache_halves(kv_cache),
                out.data_ptr(), block_table.data_ptr(), block_table.stride(0))
        rest = (query_start_loc.data_ptr(), seq_lens.data_ptr(), seq_lens.shape[0], num_heads,
                num_kv_heads, head_dim, block_size, scale, sliding_window or 0, softcap,
                DTYPE_CODES[q.dtype], torch.get_num_threads(),
                attention_path(tiled, bf16_dot, batch_invariant))
        raise_on(self._run_attention(kv_cache, args, block_table.shape[1], rest),
                 "paged attention")
        return out

    def _run_attention(self, kv_cache: torch.Tensor, args: tuple, max_blocks: int,
                       rest: tuple) -> int:
        """One ``kvflow_paged_attention`` call (its arguments split at the block table's
        width, which only the worker pool takes): on the pool's threads when it is open, else
        directly. Returns the C status (0 ok, 1 no scratch memory)."""
        if self.pool is not None and self.pool.is_open:
            return self.pool.paged_attention(kv_cache, *args, max_blocks, *rest)
        return self._attn(*args, *rest)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, num_tokens: int) -> None:
        """Write the first ``num_tokens`` rows of ``k``/``v`` into ``kv_cache`` at
        ``slot_mapping`` (what ``kv_cache[i].view(-1, Hkv, D).index_copy_(0, slots, x)`` does,
        bitwise, in one C call instead of two torch ops per layer).

        Args:
            k, v: [T, Hkv, D] of the cache's dtype, heads and head_dim contiguous (any token
                stride, e.g. views of a fused qkv row).
            kv_cache: [2, num_blocks, block_size, Hkv, D], contiguous.
            slot_mapping: int64 [>= num_tokens], contiguous; a negative slot is skipped.
            num_tokens: rows to write.

        Raises:
            ValueError: on a dtype, shape or layout mismatch, or a slot past the cache (then
                nothing is written).
        """
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        row = num_kv_heads * head_dim
        dtype = kv_cache.dtype
        for name, t in (("k", k), ("v", v)):
            if t.dtype != dtype or not t.is_cpu or t.dim() != 3 or t.shape[1] != num_kv_heads \
                    or t.shape[2] != head_dim or t.stride(2) != 1 or t.stride(1) != head_dim \
                    or t.shape[0] < num_tokens:
                raise ValueError(f"store_kv: {name} must be a CPU [>= {num_tokens}, "
                                 f"{num_kv_heads}, {head_dim}] tensor of the cache's dtype "
                                 f"{dtype} with contiguous heads")
        if dtype not in DTYPE_CODES or not kv_cache.is_cpu or not kv_cache.is_contiguous() \
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() \
                or slot_mapping.shape[0] < num_tokens:
            raise ValueError("store_kv: kv_cache must be a contiguous float32/bfloat16/float16 "
                             "CPU tensor and slot_mapping contiguous int64 [>= num_tokens]")
        status = self._store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                *cache_halves(kv_cache),
                                slot_mapping.data_ptr(), num_tokens, num_blocks * block_size,
                                row, DTYPE_CODES[dtype], torch.get_num_threads())
        if status == 2:
            raise ValueError(f"store_kv: slots must lie below {num_blocks * block_size}")

    @staticmethod
    def check_paged_indices(num_tokens: int, kv_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor) -> None:
        """Raise ValueError unless the kernel's reads stay in bounds: query_start_loc rises from
        0 to at most ``num_tokens``, each query fits its context (query_len <= seq_len), and
        each context's blocks are ids in [0, num_blocks) within its block-table row.

        The index tensors are int32 CPU tensors (the callers check that first); the checks run
        in numpy on views of them: ~27 us for a 64-request decode step where the same torch
        ops took ~104 us (a handful of small tensors, once per step).
        """
        if seq_lens.numel() == 0:
            return
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        starts, lens = query_start_loc.numpy(), seq_lens.numpy().astype(np.int64)
        query_lens = np.diff(starts)
        if starts[0] != 0 or starts[-1] > num_tokens or (query_lens < 0).any() \
                or (query_lens > lens).any():
            raise ValueError("paged attention: query_start_loc must rise from 0 to at most "
                             "num_tokens with every query_len <= its seq_len")
        blocks_needed = (lens + block_size - 1) // block_size
        if blocks_needed.max() > block_table.shape[1]:
            raise ValueError("paged attention: a seq_len needs more blocks than its "
                             "block_table row holds")
        used = np.arange(block_table.shape[1]) < blocks_needed[:, None]
        ids = block_table[: lens.shape[0]].numpy()[used]
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            raise ValueError(f"paged attention: block ids must lie in [0, {num_blocks})")

    @staticmethod
    def _check(q, kv_cache, query_start_loc, seq_lens, block_table, num_heads, num_kv_heads,
               head_dim, cache_dim) -> None:
        i32 = torch.int32
        if q.dtype in DTYPE_CODES and kv_cache.dtype == q.dtype and q.is_cpu \
                and kv_cache.is_cpu and query_start_loc.is_cpu and seq_lens.is_cpu \
                and block_table.is_cpu and query_start_loc.dtype == i32 \
                and seq_lens.dtype == i32 and block_table.dtype == i32 \
                and kv_cache.is_contiguous() and q.stride(2) == 1 and q.stride(1) == head_dim \
                and query_start_loc.is_contiguous() and seq_lens.is_contiguous() \
                and block_table.stride(1) == 1 and cache_dim == head_dim \
                and num_heads % num_kv_heads == 0 \
                and query_start_loc.shape[0] == seq_lens.shape[0] + 1 \
                and block_table.shape[0] >= seq_lens.shape[0]:
            return  # the hot path: one test; below, which rule is broken
        if q.dtype not in DTYPE_CODES or kv_cache.dtype != q.dtype:
            raise ValueError(f"native paged attention needs q and kv_cache of one dtype among "
                             f"float32/bfloat16/float16, got {q.dtype} and {kv_cache.dtype}")
        tensors = (q, kv_cache, query_start_loc, seq_lens, block_table)
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("native paged attention runs on CPU tensors only")
        if any(t.dtype != torch.int32 for t in (query_start_loc, seq_lens, block_table)):
            raise ValueError("query_start_loc, seq_lens and block_table must be int32")
        if not kv_cache.is_contiguous() or q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError("kv_cache must be contiguous and q [tokens, heads, head_dim] must be "
                             "contiguous over heads and head_dim")
        if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous()
                and block_table.stride(1) == 1):
            raise ValueError("query_start_loc, seq_lens and block_table rows must be contiguous")
        if cache_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(f"q has {num_heads} heads of {head_dim}, the cache {num_kv_heads} "
                             f"of {cache_dim}: need equal head_dim and heads % kv_heads == 0")
        if query_start_loc.shape[0] != seq_lens.shape[0] + 1 \
                or block_table.shape[0] < seq_lens.shape[0]:
            raise ValueError("query_start_loc needs num_reqs + 1 entries and block_table a row "
                             "per request")


def check_softcap(softcap: float) -> None:
    """Raise ValueError unless ``softcap`` (attention-score soft cap; 0 = off) is finite and
    >= 0."""
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no soft-capping), "
                         f"got {softcap!r}")


# The ``tiled`` argument of ``kvflow_paged_attention`` (csrc/cpu_attention.c): which path a
# tile of query tokens takes.
ROW_BY_ROW, REGISTER_TILED, BF16_DOT_TILED, BATCH_INVARIANT = 0, 1, 2, 3


def attention_path(tiled: bool, bf16_dot: bool, batch_invariant: bool) -> int:
    """The native kernel's path code for :meth:`AttentionKernels.paged_attention`'s flags:
    ``batch_invariant`` overrides the others; ``bf16_dot`` counts only with ``tiled`` (the C
    side falls back to the register-tiled path where the build or dtype has no bf16 dots)."""
    if batch_invariant:
        return BATCH_INVARIANT
    if not tiled:
        return ROW_BY_ROW
    return BF16_DOT_TILED if bf16_dot else REGISTER_TILED


def cache_halves(kv_cache: torch.Tensor) -> tuple[int, int]:
    """The addresses of ``kv_cache[0]`` (keys) and ``kv_cache[1]`` (values) of a contiguous
    [2, ...] cache, by arithmetic: indexing makes two tensor views, ~1.5 us each per call."""
    base = kv_cache.data_ptr()
    return base, base + kv_cache.stride(0) * kv_cache.element_size()
