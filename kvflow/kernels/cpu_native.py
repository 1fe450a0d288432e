"""Native CPU kernels: C sources under ``kernels/csrc/``, compiled on first use, called via ctypes.

The C code is plain C11 + OpenMP (no torch headers), so it builds in about a second with the
system C compiler (``$CC``, else ``cc``); building and caching one library per instruction-set
level is :mod:`kvflow.kernels.cpu_build`'s job. :func:`native_cpu_kernels` loads the best level
this CPU runs (AVX512 with bf16 dot products, AVX512, AVX2, baseline; ``KVFLOW_CPU_ISA=avx2``
etc. picks a lower one, for tests and comparisons). ``-fopenmp`` links ``libgomp.so.1``; torch's
CPU build has already loaded a library of that name, so the kernels run on torch's OpenMP
runtime and thread count instead of a second pool competing for the cores.

Where no compiler is available or every build fails, :func:`native_cpu_kernels` returns None
(the reason is logged once) and callers fall back to the plain-torch kernels.
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import logging
import math
import os
import shutil
import subprocess
from pathlib import Path

import torch

from kvflow.config import cache_dir
from kvflow.kernels import cpu_build

logger = logging.getLogger(__name__)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


class NativeCpuKernels:
    """The compiled library's entry points, with argument checks done in Python."""

    def __init__(self, lib: ctypes.CDLL, isa: str = "native") -> None:
        self.lib = lib  # entry points bound elsewhere (kernels/cpu_attention_kvq.py)
        self.isa = isa  # the instruction-set level the library was built for
        self.pool = None  # a kernels.cpu_pool.CpuPool that shares gemm's work, when set
        self._attn = lib.kvflow_paged_attention
        self._attn.restype = _int
        self._attn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64,
                               _i64, _i64, _i64, _f32, _i64, _int, _int, _int]
        self._store_kv = lib.kvflow_store_kv
        self._store_kv.restype = _int
        self._store_kv.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                                   _int, _int]
        self._rms_norm = lib.kvflow_rms_norm
        self._rms_norm.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32,
                                   _int, _int]
        self._silu_and_mul = lib.kvflow_silu_and_mul
        self._silu_and_mul.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _int, _int]
        self._rotary = lib.kvflow_rotary
        self._rotary.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr,
                                 _i64, _i64, _int, _int, _int]
        for fn in (self._rms_norm, self._silu_and_mul, self._rotary):
            fn.restype = _int
        self._gemm_packed_size = lib.kvflow_gemm_packed_size
        self._gemm_packed_size.restype = _i64
        self._gemm_packed_size.argtypes = [_i64, _i64, _int]
        self._gemm_x_dtype = lib.kvflow_gemm_x_dtype
        self._gemm_x_dtype.restype = _int
        self._gemm_x_dtype.argtypes = [_int]
        # the x dtype code each weight dtype code takes (kvflow_gemm_x_dtype), and packed sizes
        self._x_codes = {code: self._gemm_x_dtype(code) for code in _DTYPES}
        self._packed_sizes: dict[tuple[int, int, int], int] = {}
        self._gemm_pack = lib.kvflow_gemm_pack
        self._gemm_pack.restype = None
        self._gemm_pack.argtypes = [_ptr, _i64, _i64, _i64, _int, _ptr, _int]
        self._gemm = lib.kvflow_gemm
        self._gemm.restype = _int
        self._gemm.argtypes = [_ptr, _i64, _int, _ptr, _int, _ptr, _ptr, _i64, _int, _i64, _i64,
                               _i64, _int]
        self._gguf_gemm = lib.kvflow_gguf_gemm
        self._gguf_gemm.restype = _int
        self._gguf_gemm.argtypes = [_ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _i64, _i64, _i64,
                                    _i64, _int]
        self._gguf_dequantize = lib.kvflow_gguf_dequantize
        self._gguf_dequantize.restype = _int
        self._gguf_dequantize.argtypes = [_ptr, _i64, _int, _i64, _i64, _ptr, _int]
        self._bind_threads = lib.kvflow_bind_threads
        self._bind_threads.restype = _int
        self._bind_threads.argtypes = [_ptr, _int]

    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float,
                        sliding_window: int | None = None, validate: bool = True,
                        tiled: bool = True, bf16_dot: bool = True,
                        batch_invariant: bool = False) -> torch.Tensor:
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

        Returns:
            [num_tokens, num_heads, head_dim] in q's dtype; rows past
            ``query_start_loc[-1]`` (padding) are unspecified.

        Raises:
            ValueError: on a dtype, device, layout or head-count mismatch, or (validate) an index
                that would read outside q or the cache.
            MemoryError: when the kernel cannot allocate its per-thread scratch.
        """
        num_tokens, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
        self._check(q, kv_cache, query_start_loc, seq_lens, block_table, num_heads,
                    num_kv_heads, head_dim, cache_dim)
        if validate:
            self.check_paged_indices(num_tokens, kv_cache, query_start_loc, seq_lens, block_table)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
        args = (q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                out.data_ptr(), block_table.data_ptr(), block_table.stride(0))
        rest = (query_start_loc.data_ptr(), seq_lens.data_ptr(), seq_lens.shape[0], num_heads,
                num_kv_heads, head_dim, block_size, scale, sliding_window or 0,
                _DTYPE_CODES[q.dtype], torch.get_num_threads(),
                3 if batch_invariant else int(tiled) * (1 + int(bf16_dot)))
        if self.pool is not None and self.pool.is_open:
            status = self.pool.paged_attention(kv_cache, *args, block_table.shape[1], *rest)
        else:
            status = self._attn(*args, *rest)
        _raise_on(status, "paged attention")
        return out

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
        if dtype not in _DTYPE_CODES or not kv_cache.is_cpu or not kv_cache.is_contiguous() \
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() \
                or slot_mapping.shape[0] < num_tokens:
            raise ValueError("store_kv: kv_cache must be a contiguous float32/bfloat16/float16 "
                             "CPU tensor and slot_mapping contiguous int64 [>= num_tokens]")
        status = self._store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                                slot_mapping.data_ptr(), num_tokens, num_blocks * block_size,
                                row, _DTYPE_CODES[dtype], torch.get_num_threads())
        if status == 2:
            raise ValueError(f"store_kv: slots must lie below {num_blocks * block_size}")

    @staticmethod
    def check_paged_indices(num_tokens: int, kv_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor) -> None:
        """Raise ValueError unless the kernel's reads stay in bounds: query_start_loc rises from
        0 to at most ``num_tokens``, each query fits its context (query_len <= seq_len), and
        each context's blocks are ids in [0, num_blocks) within its block-table row."""
        if seq_lens.numel() == 0:
            return
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) > num_tokens \
                or bool((query_lens < 0).any()) or bool((query_lens > seq_lens).any()):
            raise ValueError("paged attention: query_start_loc must rise from 0 to at most "
                             "num_tokens with every query_len <= its seq_len")
        blocks_needed = (seq_lens.long() + block_size - 1) // block_size
        if int(blocks_needed.max()) > block_table.shape[1]:
            raise ValueError("paged attention: a seq_len needs more blocks than its "
                             "block_table row holds")
        used = torch.arange(block_table.shape[1]) < blocks_needed.unsqueeze(1)
        ids = block_table[: seq_lens.shape[0]][used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"paged attention: block ids must lie in [0, {num_blocks})")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """RMSNorm of rows ``x`` [N, H] (HF ``LlamaRMSNorm`` rounding; see
        :class:`kvflow.layers.norm.RMSNorm`), optionally after adding ``residual`` [N, H].

        Returns ``y`` [N, H], or ``(y, x + residual)`` with a residual; fresh tensors, inputs
        untouched. Raises ValueError on a dtype/shape/layout mismatch.
        """
        dtype = x.dtype
        if not (_rows(x, dtype) and weight.dtype == dtype and weight.dim() == 1
                and weight.shape[0] == x.shape[1] and weight.is_contiguous()
                and (residual is None or (_rows(residual, dtype)
                                          and residual.shape == x.shape))):
            _rms_norm_error(x, weight, residual)  # one test on the hot path; details here
        rows, hidden = x.shape
        out = torch.empty(rows, hidden, dtype=dtype)
        if residual is None:
            status = self._rms_norm(x.data_ptr(), x.stride(0), None, 0, None, weight.data_ptr(),
                                    out.data_ptr(), rows, hidden, eps, _DTYPE_CODES[dtype],
                                    torch.get_num_threads())
            _raise_on(status, "rms_norm")
            return out
        new_residual = torch.empty(rows, hidden, dtype=dtype)
        status = self._rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(),
                                residual.stride(0), new_residual.data_ptr(), weight.data_ptr(),
                                out.data_ptr(), rows, hidden, eps, _DTYPE_CODES[dtype],
                                torch.get_num_threads())
        _raise_on(status, "rms_norm")
        return out, new_residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU gate: x [N, 2I] -> round(silu(x[:, :I])) * x[:, I:] as a fresh [N, I] tensor
        (torch's rounding in 16-bit dtypes). Raises ValueError on a dtype/layout mismatch."""
        if not _rows(x, x.dtype) or x.shape[1] % 2:
            _check_rows("x", x, x.dtype)
            raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[1]}")
        rows, width = x.shape
        out = torch.empty(rows, width // 2, dtype=x.dtype)
        status = self._silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, width // 2,
                                    _DTYPE_CODES[x.dtype], torch.get_num_threads())
        _raise_on(status, "silu_and_mul")
        return out

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding in place (same math as :class:`kvflow.layers.rotary.RotaryEmbedding`).

        Args:
            positions: int64 [T]; q: [T, Hq, D] and k: [T, Hkv, D], one dtype, heads and
                head_dim contiguous (any token stride); cos_sin_cache: float32
                [max_position, rot_dim] (cos half, then sin half), contiguous.
            is_neox: rotate halves (True) or interleaved pairs (GPT-J).

        Returns:
            (q, k), rotated in place. Raises ValueError on a mismatch or a position outside the
            cache.
        """
        tokens, num_heads, head_dim = q.shape
        rot_dim = cos_sin_cache.shape[1]
        for name, t in (("q", q), ("k", k)):
            if t.dtype not in _DTYPE_CODES or t.dtype != q.dtype or not t.is_cpu \
                    or t.stride(2) != 1 or t.stride(1) != head_dim or t.shape[0] != tokens:
                raise ValueError(f"rotary: {name} must be a CPU [T, heads, {head_dim}] tensor of "
                                 f"q's dtype with contiguous heads")
        if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous() \
                or rot_dim > head_dim or rot_dim % 2:
            raise ValueError("rotary: cos_sin_cache must be contiguous float32 [P, rot_dim] with "
                             "an even rot_dim <= head_dim")
        positions = positions.to(torch.int64).contiguous()
        # the kernel checks the positions (before rotating anything): no reduction and sync
        # per layer here
        status = self._rotary(positions.data_ptr(), q.data_ptr(), q.stride(0), num_heads,
                              k.data_ptr(), k.stride(0), k.shape[1], head_dim, rot_dim,
                              cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], tokens,
                              int(is_neox), _DTYPE_CODES[q.dtype], torch.get_num_threads())
        if status == 2:
            raise ValueError(f"rotary: positions must lie in [0, {cos_sin_cache.shape[0]})")
        _raise_on(status, "rotary")
        return q, k

    def _packed_size(self, n: int, k: int, code: int) -> int:
        """kvflow_gemm_packed_size, remembered per (n, k, dtype code): one dict lookup per GEMM
        call instead of a C call."""
        key = (n, k, code)
        size = self._packed_sizes.get(key)
        if size is None:
            size = self._packed_sizes[key] = self._gemm_packed_size(n, k, code)
        return size

    def gemm_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """Pack ``weight`` [N, K] (fp32, bf16 or fp16 CPU, unit stride along K) once for
        :meth:`gemm`.

        Returns a 1-D tensor of the weight's dtype in the library's panel layout (panels of 16
        or 32 output columns, k-major; bf16 in k-pairs where the CPU has AVX512-BF16; see
        ``csrc/cpu_gemm.c``). Raises ValueError on another dtype, device or layout.
        """
        if weight.dtype not in _DTYPE_CODES or weight.device.type != "cpu" \
                or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(f"gemm_pack needs a 2-D float32/bfloat16/float16 CPU weight with "
                             f"unit-stride rows, got {weight.dtype} {tuple(weight.shape)} on "
                             f"{weight.device}")
        n, k = weight.shape
        code = _DTYPE_CODES[weight.dtype]
        packed = torch.empty(self._gemm_packed_size(n, k, code), dtype=weight.dtype)
        self._gemm_pack(weight.data_ptr(), weight.stride(0), n, k, code, packed.data_ptr(),
                        torch.get_num_threads())
        return packed

    def gemm_panel_width(self) -> int:
        """Output columns per panel of :meth:`gemm_pack`'s layout (16, or 32 in AVX512
        builds): the packed size of a [1, 2] fp32 weight over its depth."""
        return self._packed_size(1, 2, _DTYPE_CODES[torch.float32]) // 2

    def gemm_x_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The activation dtype :meth:`gemm` takes with packed weights of ``weight_dtype``:
        bf16 for bf16 weights where the CPU multiplies bf16 pairs (AVX512-BF16), else fp32."""
        return _DTYPES[self._gemm_x_dtype(_DTYPE_CODES[weight_dtype])]

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int,
             bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``x @ weight.T + bias`` against ``packed`` = :meth:`gemm_pack` (``weight`` [n, K]).

        A 16-bit weight is widened to fp32 in registers (exact) or, for bf16 on AVX512-BF16 or
        AMX, multiplied with bf16 ``x`` by bf16 dot-product instructions or tiles; either way
        the product accumulates in fp32 and is returned in fp32, never rounded to 16 bits, or
        (``out_dtype`` 16-bit) rounded once to nearest even inside the kernel, as
        ``.to(out_dtype)`` of the fp32 result would give without its extra pass over memory.

        Args:
            x: [..., K] CPU activations of :meth:`gemm_x_dtype` (another float dtype is
                converted first; so is a strided last dim).
            packed: the packed weight (float32, bfloat16 or float16); n: its output features.
            bias: [n] float32, or None.
            out_dtype: float32 (default), bfloat16 or float16.

        Returns:
            [..., n] ``out_dtype``, a fresh tensor. Each element is summed in the same k order
            whatever the thread count.

        Raises:
            ValueError: on a dtype, device or size mismatch.
            MemoryError: when the kernel cannot allocate its work-sharing state.
        """
        if self.pool is not None and self.pool.is_open:
            return self.pool.gemm(x, packed, n, bias, out_dtype)
        rows, code, x_code = self.gemm_operands(x, packed, n, bias)
        k = x.shape[-1]
        out = torch.empty(rows.shape[0], n, dtype=out_dtype)
        status = self._gemm(rows.data_ptr(), rows.stride(0), x_code, packed.data_ptr(), code,
                            None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                            gemm_out_code(out_dtype), rows.shape[0], n, k,
                            torch.get_num_threads())
        _raise_on(status, "gemm")
        return out.view(*x.shape[:-1], n)

    def gemm_operands(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                      bias: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
        """(x as [rows, K] unit-stride rows of the dtype the weight takes, the weight's dtype
        code, x's dtype code) for :meth:`gemm`.

        Raises:
            ValueError: on a dtype, device or size mismatch.
        """
        k = x.shape[-1]
        code = _DTYPE_CODES.get(packed.dtype, -1)
        x_code = self._x_codes.get(code)
        if bias is None and x_code is not None and x.dtype == _DTYPES[x_code] and x.is_cpu \
                and x.dim() == 2 and x.stride(1) == 1 \
                and packed.numel() == self._packed_size(n, k, code):
            return x, code, x_code  # the hot path (a model's projections): nothing to convert
        if not x.is_cpu or not x.is_floating_point() or code < 0 \
                or packed.numel() != self._packed_size(n, k, code):
            raise ValueError(f"gemm: x must be a float CPU [..., K] matching a packed [{n}, K] "
                             f"weight, got {x.dtype} {tuple(x.shape)} on {x.device}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)
                                 or not bias.is_contiguous()):
            raise ValueError(f"gemm: bias must be contiguous float32 [{n}]")
        rows = x.reshape(math.prod(x.shape[:-1]), k).to(_DTYPES[x_code])
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        return rows, code, x_code

    def gguf_gemm(self, x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` with W kept as GGML blocks, dequantized inside the product
        (``csrc/cpu_gguf.c``).

        Args:
            x: float32 CPU [M, K] (rows may be strided, elements unit-stride).
            raw: uint8 CPU [N, row_bytes] contiguous, the blocks of one GGML type among
                Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K; k: K (elements per row).
            bias: float32 [N] contiguous, or None.

        Returns:
            float32 [M, N], a fresh tensor.

        Raises:
            ValueError: on a dtype/layout mismatch or an unknown GGML type.
            MemoryError: when the kernel cannot allocate its tile buffer.
        """
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != k \
                or raw.dtype != torch.uint8 or not raw.is_contiguous() or raw.dim() != 2:
            raise ValueError(f"gguf_gemm: x must be float32 [M, {k}] with unit-stride rows and "
                             "raw uint8 [N, row_bytes] contiguous")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            raise ValueError("gguf_gemm: bias must be contiguous float32 [N]")
        m, n = x.shape[0], raw.shape[0]
        out = torch.empty(m, n, dtype=torch.float32)
        status = self._gguf_gemm(x.data_ptr(), x.stride(0), raw.data_ptr(), raw.shape[1],
                                 ggml_type, None if bias is None else bias.data_ptr(),
                                 out.data_ptr(), n, m, n, k, torch.get_num_threads())
        if status == 2:
            raise ValueError(f"gguf_gemm: GGML type {ggml_type} has no native kernel")
        _raise_on(status, "gguf_gemm")
        return out

    def gguf_dequantize(self, raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        """float32 [N, k] of the GGML blocks ``raw`` uint8 [N, row_bytes] (contiguous).

        Raises:
            ValueError: on a dtype/layout mismatch or an unknown GGML type.
        """
        if raw.dtype != torch.uint8 or not raw.is_contiguous() or raw.dim() != 2:
            raise ValueError("gguf_dequantize: raw must be contiguous uint8 [N, row_bytes]")
        out = torch.empty(raw.shape[0], k, dtype=torch.float32)
        if self._gguf_dequantize(raw.data_ptr(), raw.shape[1], ggml_type, raw.shape[0], k,
                                 out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"gguf_dequantize: GGML type {ggml_type} has no native kernel")
        return out

    def bind_threads(self, cpus: list[int]) -> bool:
        """Pin the OpenMP threads of the calling thread's parallel regions, thread i to
        ``cpus[i]`` (``len(cpus)`` threads; the caller is thread 0). Call it from the thread
        that runs the model, after ``torch.set_num_threads(len(cpus))``. Returns False when a
        thread could not be pinned (a CPU outside the affinity mask or the machine)."""
        ids = torch.tensor(cpus, dtype=torch.int32)
        return self._bind_threads(ids.data_ptr(), len(cpus)) == 0

    @staticmethod
    def _check(q, kv_cache, query_start_loc, seq_lens, block_table, num_heads, num_kv_heads,
               head_dim, cache_dim) -> None:
        i32 = torch.int32
        if q.dtype in _DTYPE_CODES and kv_cache.dtype == q.dtype and q.is_cpu \
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
        if q.dtype not in _DTYPE_CODES or kv_cache.dtype != q.dtype:
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


def _rows(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``t`` is a 2-D CPU tensor of ``dtype`` (one the kernels take) with unit-stride
    rows: the hot path's one test (:func:`_check_rows` says what is wrong)."""
    return t.dtype == dtype and t.is_cpu and t.dim() == 2 and t.stride(1) == 1 \
        and dtype in _DTYPE_CODES


def _rms_norm_error(x: torch.Tensor, weight: torch.Tensor,
                    residual: torch.Tensor | None) -> None:
    """Raise the ValueError saying why :meth:`NativeCpuKernels.rms_norm` refuses its operands.

    Raises:
        ValueError: always.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, hidden], got {tuple(x.shape)}")
    _check_rows("x", x, weight.dtype)
    hidden = x.shape[1]
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    if residual is not None:
        _check_rows("residual", residual, x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    raise ValueError("rms_norm: unsupported operands")


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype not in _DTYPE_CODES or t.dtype != dtype or t.device.type != "cpu" \
            or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D CPU float32/bfloat16/float16 tensor of dtype "
                         f"{dtype} with unit-stride rows, got {t.dtype} {tuple(t.shape)}")


def gemm_out_code(dtype: torch.dtype) -> int:
    """The kernels' code of a GEMM's output dtype (float32, bfloat16, float16).

    Raises:
        ValueError: on another dtype (the kernels write no other).
    """
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(f"gemm: out_dtype must be float32, bfloat16 or float16, got {dtype}")
    return code


def _raise_on(status: int, op: str) -> None:
    if status:
        raise MemoryError(f"native {op} could not allocate its per-thread scratch")


def _open(lib_path: Path, isa: str) -> NativeCpuKernels:
    """dlopen ``lib_path`` and bind the entry points; a library without them is closed again,
    or the loader would hand back that same library for the path after a rebuild."""
    lib = ctypes.CDLL(str(lib_path))
    try:
        return NativeCpuKernels(lib, isa)
    except AttributeError:
        dlclose = getattr(_ctypes, "dlclose", None)
        if dlclose is not None:
            dlclose(lib._handle)
        raise


def _load(cc: str, sources: list[Path], level: cpu_build.IsaLevel) -> NativeCpuKernels:
    """The kernels of ISA ``level``, building its library when missing or not intact, and
    rebuilding once when a cached library fails to load (a foreign file, missing symbols)."""
    target = cpu_build.library_path(cc, sources, cache_dir(), level)
    built = not cpu_build.intact(target)
    if built:
        cpu_build.build(cc, sources, target, level)
    try:
        return _open(target, level.name)
    except (OSError, AttributeError) as exc:
        if built:
            raise
        logger.warning("cached native CPU kernels %s do not load (%s); rebuilding", target, exc)
    cpu_build.build(cc, sources, target, level)
    return _open(target, level.name)


def native_kernels_for(x: torch.Tensor) -> NativeCpuKernels | None:
    """The native kernels when ``x`` is a CPU tensor of a dtype they handle and they could be
    built, else None (the caller runs its torch code)."""
    if not x.is_cpu or x.dtype not in _DTYPE_CODES:
        return None
    return native_cpu_kernels()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def native_cpu_kernels_for_isa(name: str) -> NativeCpuKernels | None:
    """The kernels built for ISA level ``name`` (:data:`kvflow.kernels.cpu_build.X86_LEVELS`),
    or None when this CPU cannot run it, no compiler is found or the build fails (for tests and
    comparisons; the engine uses :func:`native_cpu_kernels`)."""
    cc = _compiler()
    level = next((lv for lv in cpu_build.isa_levels_for_cpu() if lv.name == name), None)
    if cc is None or level is None:
        return None
    sources = [Path(__file__).parent / "csrc" / src for src in cpu_build.SOURCES]
    try:
        return _load(cc, sources, level)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels for %s unavailable: %s", name, exc)
        return None


@functools.cache
def native_cpu_kernels() -> NativeCpuKernels | None:
    """The compiled kernels of the best ISA level this CPU runs, building them on first use
    (a level whose build fails falls back to the next); None (logged once) if unavailable.

    ``KVFLOW_NATIVE_CPU=0`` disables them (the torch kernels are used instead);
    ``KVFLOW_CPU_ISA=<level>`` (amx_bf16, avx512_bf16, avx512, avx2, x86-64) asks for a lower level
    than the best, e.g. to test the AVX2 path on an AVX512 machine.
    """
    if os.environ.get("KVFLOW_NATIVE_CPU", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler (cc/gcc) found: CPU attention uses the torch backend")
        return None
    levels = cpu_build.isa_levels_for_cpu()
    forced = os.environ.get("KVFLOW_CPU_ISA")
    if forced:
        chosen = [lv for lv in levels if lv.name == forced]
        if not chosen:
            logger.warning("KVFLOW_CPU_ISA=%s is not one of the levels this CPU runs (%s); "
                           "using the best", forced, ", ".join(lv.name for lv in levels))
        levels = chosen or levels
    sources = [Path(__file__).parent / "csrc" / name for name in cpu_build.SOURCES]
    for level in levels:
        try:
            return _load(cc, sources, level)
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
            logger.warning("native CPU kernels for %s unavailable: %s", level.name, exc)
    logger.warning("native CPU kernels unavailable, using the torch backend")
    return None
