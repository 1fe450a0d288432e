"""Python wrappers of the native GEMM kernels (``csrc/cpu_gemm.c``: packed fp32/bf16/fp16
weights; ``csrc/cpu_gguf.c``: GGML blocks dequantized inside the product). A mixin of
:class:`kvflow.kernels.cpu_native.NativeCpuKernels`; the choice between them and oneDNN is
:mod:`kvflow.kernels.gemm_select`'s.
"""

from __future__ import annotations

import ctypes
import math

import torch

from kvflow.kernels.cpu_native_common import (
    DTYPE_CODES,
    DTYPES,
    bind,
    c_int,
    gemm_out_code,
    i64,
    ptr,
    raise_on,
)


class GemmKernels:
    """Packing and multiplying by packed weights, and the GGUF products."""

    def _bind_gemm(self, lib: ctypes.CDLL) -> None:
        self._gemm_packed_size = bind(lib, "kvflow_gemm_packed_size", i64, [i64, i64, c_int])
        self._gemm_x_dtype = bind(lib, "kvflow_gemm_x_dtype", c_int, [c_int])
        # the x dtype code each weight dtype code takes (kvflow_gemm_x_dtype), and packed sizes
        self._x_codes = {code: self._gemm_x_dtype(code) for code in DTYPES}
        self._packed_sizes: dict[tuple[int, int, int], int] = {}
        self._gemm_pack = bind(lib, "kvflow_gemm_pack", None,
                               [ptr, i64, i64, i64, c_int, ptr, c_int])
        self._gemm_rows = bind(lib, "kvflow_gemm_rows", c_int,
                               [ptr, c_int, i64, i64, ptr, i64, ptr, i64])
        self._gemm = bind(lib, "kvflow_gemm", c_int,
                          [ptr, i64, c_int, ptr, c_int, ptr, ptr, i64, c_int, i64, i64, i64,
                           c_int])
        self._gguf_gemm = bind(lib, "kvflow_gguf_gemm", c_int,
                               [ptr, i64, ptr, i64, c_int, ptr, ptr, i64, i64, i64, i64, c_int])
        self._gguf_dequantize = bind(lib, "kvflow_gguf_dequantize", c_int,
                                     [ptr, i64, c_int, i64, i64, ptr, c_int])
        # the INT8 weight-only product (csrc/cpu_quant_gemm.c; wrapped by
        # kvflow.kernels.cpu_quant.int8_gemm), bound here like every entry point a forward
        # calls: CPU step graphs record the calls made through this object's attributes
        self._int8_gemm = bind(lib, "kvflow_int8_gemm", c_int,
                               [ptr, i64, c_int, ptr, i64, ptr, ptr, ptr, i64, c_int, i64, i64,
                                i64, c_int])
        # with group scales [N, K / G] (GPTQ 8-bit, compressed-tensors W8A16 groups)
        self._int8_gemm_grouped = bind(lib, "kvflow_int8_gemm_grouped", c_int,
                                       [ptr, i64, c_int, ptr, i64, ptr, i64, ptr, ptr, i64,
                                        c_int, i64, i64, i64, c_int])

    def _packed_size(self, n: int, k: int, code: int) -> int:
        """kvflow_gemm_packed_size, remembered per (n, k, dtype code): one dict lookup per GEMM
        call instead of a C call."""
        key = (n, k, code)
        size = self._packed_sizes.get(key)
        if size is None:
            size = self._packed_sizes[key] = self._gemm_packed_size(n, k, code)
        return size

    def gemm_packed_numel(self, n: int, k: int, dtype: torch.dtype) -> int:
        """Elements of :meth:`gemm_pack`'s result for a weight [n, k] of ``dtype`` (fp32, bf16
        or fp16). Raises ValueError on another dtype."""
        if dtype not in DTYPE_CODES:
            raise ValueError(f"gemm_packed_numel: no packing for {dtype}")
        return self._packed_size(n, k, DTYPE_CODES[dtype])

    def gemm_pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pack ``weight`` [N, K] (fp32, bf16 or fp16 CPU, unit stride along K) once for
        :meth:`gemm`.

        Args:
            weight: [N, K] the weight.
            out: where to pack (e.g. a :class:`~kvflow.platforms.cpu_memory.HugePageArena`
                tensor): a contiguous 1-D CPU tensor of the weight's dtype with
                :meth:`gemm_packed_numel` elements; None allocates one.

        Returns a 1-D tensor of the weight's dtype (``out`` when given) in the library's panel
        layout (panels of 16 or 32 output columns, k-major; bf16 in k-pairs where the CPU has
        AVX512-BF16; see ``csrc/cpu_gemm.c``). Raises ValueError on another dtype, device or
        layout, or an ``out`` of the wrong dtype, size or layout.
        """
        if weight.dtype not in DTYPE_CODES or weight.device.type != "cpu" \
                or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(f"gemm_pack needs a 2-D float32/bfloat16/float16 CPU weight with "
                             f"unit-stride rows, got {weight.dtype} {tuple(weight.shape)} on "
                             f"{weight.device}")
        n, k = weight.shape
        code = DTYPE_CODES[weight.dtype]
        numel = self._packed_size(n, k, code)
        if out is None:
            out = torch.empty(numel, dtype=weight.dtype)
        elif out.dtype != weight.dtype or out.device.type != "cpu" or out.dim() != 1 \
                or out.numel() != numel or not out.is_contiguous():
            raise ValueError(f"gemm_pack's out must be a contiguous 1-D {weight.dtype} CPU "
                             f"tensor of {numel} elements, got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        self._gemm_pack(weight.data_ptr(), weight.stride(0), n, k, code, out.data_ptr(),
                        torch.get_num_threads())
        return out

    def gemm_rows(self, packed: torch.Tensor, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight [n, k] that :meth:`gemm_pack` packed into ``packed``:
        [len(ids), k] in the weight's dtype, bit for bit its rows (an embedding lookup from a
        tied LM head's packed copy; one C call, one thread).

        Args:
            packed: :meth:`gemm_pack`'s result for a weight [n, k].
            ids: int64 [T] row indices, contiguous.

        Raises:
            ValueError: when ``ids`` is not a contiguous int64 CPU tensor or an id lies outside
                [0, n) (``out`` is then not returned).
        """
        if ids.dtype != torch.int64 or not ids.is_cpu or ids.dim() != 1 \
                or not ids.is_contiguous():
            raise ValueError(f"gemm_rows: ids must be a contiguous 1-D int64 CPU tensor, got "
                             f"{ids.dtype} {tuple(ids.shape)}")
        out = torch.empty(ids.shape[0], k, dtype=packed.dtype)
        if self._gemm_rows(packed.data_ptr(), DTYPE_CODES[packed.dtype], n, k, ids.data_ptr(),
                           ids.shape[0], out.data_ptr(), k):
            raise ValueError(f"gemm_rows: ids must lie in [0, {n})")
        return out

    def gemm_panel_width(self) -> int:
        """Output columns per panel of :meth:`gemm_pack`'s layout (16, or 32 in AVX512
        builds): the packed size of a [1, 2] fp32 weight over its depth."""
        return self._packed_size(1, 2, DTYPE_CODES[torch.float32]) // 2

    def gemm_x_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The activation dtype :meth:`gemm` takes with packed weights of ``weight_dtype``:
        bf16 for bf16 weights (multiplied as bf16 pairs on AVX512-BF16; elsewhere widened to
        fp32 inside the call, exactly, so a bf16 model's activations need no torch conversion
        between the native calls of a step), fp32 for fp32 and fp16 weights."""
        return DTYPES[self._gemm_x_dtype(DTYPE_CODES[weight_dtype])]

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int,
             bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``x @ weight.T + bias`` against ``packed`` = :meth:`gemm_pack` (``weight`` [n, K]).

        A 16-bit weight is widened to fp32 in registers (exact; bf16 ``x`` is widened once per
        call too) or, for bf16 on AVX512-BF16 or AMX, multiplied with bf16 ``x`` by bf16
        dot-product instructions or tiles; either way
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
        raise_on(status, "gemm")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)  # a view costs ~1 us

    def gemm_operands(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                      bias: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
        """(x as [rows, K] unit-stride rows of the dtype the weight takes, the weight's dtype
        code, x's dtype code) for :meth:`gemm`.

        Raises:
            ValueError: on a dtype, device or size mismatch.
        """
        k = x.shape[-1]
        code = DTYPE_CODES.get(packed.dtype, -1)
        x_code = self._x_codes.get(code)
        if bias is None and x_code is not None and x.dtype == DTYPES[x_code] and x.is_cpu \
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
        rows = x.reshape(math.prod(x.shape[:-1]), k).to(DTYPES[x_code])
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
        raise_on(status, "gguf_gemm")
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
