"""Python wrappers of the native row-wise kernels (``csrc/cpu_elementwise.c``): RMSNorm (with
the residual add), SiLU-and-mul, rotary embedding and embedding lookups (plain tables, and
per-row-scaled INT8 tables from ``csrc/cpu_quant_embed.c``), GELU and GELU-and-mul
(``csrc/cpu_gelu.c``). A mixin of
:class:`kvflow.kernels.cpu_native.NativeCpuKernels`.
"""

from __future__ import annotations

import ctypes

import torch

from kvflow.kernels.cpu_native_common import (
    DTYPE_CODES,
    bind,
    c_int,
    check_rows,
    f32,
    i64,
    ptr,
    raise_on,
    rows_ok,
)


class ElementwiseKernels:
    """The fused row-wise ops, each one C call over the rows."""

    def _bind_elementwise(self, lib: ctypes.CDLL) -> None:
        self._rms_norm = bind(lib, "kvflow_rms_norm", c_int,
                              [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, c_int, c_int])
        self._embedding_rows = bind(lib, "kvflow_embedding_rows", c_int,
                                    [ptr, i64, i64, i64, i64, ptr, i64, ptr])
        self._int8_embedding_rows = bind(lib, "kvflow_int8_embedding_rows", c_int,
                                         [ptr, i64, ptr, i64, i64, ptr, i64, ptr, c_int, c_int])
        self._silu_and_mul = bind(lib, "kvflow_silu_and_mul", c_int,
                                  [ptr, i64, ptr, i64, i64, c_int, c_int])
        self._gelu = bind(lib, "kvflow_gelu", c_int, [ptr, i64, ptr, i64, i64, c_int, c_int, c_int])
        self._gelu_and_mul = bind(lib, "kvflow_gelu_and_mul", c_int,
                                  [ptr, i64, ptr, i64, i64, c_int, c_int, c_int])
        self._rotary = bind(lib, "kvflow_rotary", c_int,
                            [ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, i64, i64, c_int,
                             c_int, c_int])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """RMSNorm of rows ``x`` [N, H] (HF ``LlamaRMSNorm`` rounding; see
        :class:`kvflow.layers.norm.RMSNorm`), optionally after adding ``residual`` [N, H].

        Returns ``y`` [N, H], or ``(y, x + residual)`` with a residual; fresh tensors, inputs
        untouched. Raises ValueError on a dtype/shape/layout mismatch.
        """
        dtype = x.dtype
        if not (rows_ok(x, dtype) and weight.dtype == dtype and weight.dim() == 1
                and weight.shape[0] == x.shape[1] and weight.is_contiguous()
                and (residual is None or (rows_ok(residual, dtype)
                                          and residual.shape == x.shape))):
            _rms_norm_error(x, weight, residual)  # one test on the hot path; details here
        rows, hidden = x.shape
        out = torch.empty(rows, hidden, dtype=dtype)
        if residual is None:
            status = self._rms_norm(x.data_ptr(), x.stride(0), None, 0, None, weight.data_ptr(),
                                    out.data_ptr(), rows, hidden, eps, DTYPE_CODES[dtype],
                                    torch.get_num_threads())
            raise_on(status, "rms_norm")
            return out
        new_residual = torch.empty(rows, hidden, dtype=dtype)
        status = self._rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(),
                                residual.stride(0), new_residual.data_ptr(), weight.data_ptr(),
                                out.data_ptr(), rows, hidden, eps, DTYPE_CODES[dtype],
                                torch.get_num_threads())
        raise_on(status, "rms_norm")
        return out, new_residual

    def embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, table)`` in one C call: [T, K] rows of ``table`` [N, K] (any
        dtype, unit-stride rows) as a fresh contiguous tensor, bit for bit.

        Raises:
            ValueError: when ``table`` is not a 2-D CPU tensor with unit-stride rows, ``ids``
                not a 1-D int64 CPU tensor, or an id lies outside [0, N).
        """
        if table.dim() != 2 or not table.is_cpu or table.stride(1) != 1 \
                or ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_cpu:
            raise ValueError(f"embedding needs a 2-D CPU table with unit-stride rows and 1-D "
                             f"int64 CPU ids, got {tuple(table.shape)} and {ids.dtype} "
                             f"{tuple(ids.shape)}")
        ids = ids.contiguous()
        n, k = table.shape
        out = torch.empty(ids.shape[0], k, dtype=table.dtype)
        if self._embedding_rows(table.data_ptr(), table.stride(0), n, k, table.element_size(),
                                ids.data_ptr(), ids.shape[0], out.data_ptr()):
            raise ValueError(f"embedding: token ids must lie in [0, {n})")
        return out

    def int8_embedding(self, table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the INT8 table ``table`` dequantized in one C call:
        ``(table[ids].float() * scale[ids, None]).to(out_dtype)`` bit for bit (exact widening,
        one fp32 multiply, one round-to-nearest-even to a 16-bit ``out_dtype``).

        Args:
            table: int8 [N, K] CPU, unit-stride rows; scale: float32 [N] contiguous (one per
                row).
            ids: int64 [T] CPU row indices in [0, N) (a strided tensor is copied).
            out_dtype: float32, bfloat16 or float16.

        Returns:
            [T, K] ``out_dtype``, a fresh contiguous tensor.

        Raises:
            ValueError: on a dtype, device, shape or layout mismatch, or an id outside [0, N).
        """
        n = table.shape[0] if table.dim() == 2 else -1
        if table.dtype != torch.int8 or not table.is_cpu or table.dim() != 2 \
                or table.stride(1) != 1 or scale.dtype != torch.float32 or not scale.is_cpu \
                or scale.shape != (n,) or not scale.is_contiguous() \
                or ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_cpu \
                or out_dtype not in DTYPE_CODES:
            raise ValueError(f"int8_embedding needs an int8 CPU table [N, K] with unit-stride "
                             f"rows, contiguous float32 CPU scales [N], 1-D int64 CPU ids and "
                             f"a float32/bfloat16/float16 out_dtype, got {table.dtype} "
                             f"{tuple(table.shape)}, {scale.dtype} {tuple(scale.shape)}, "
                             f"{ids.dtype} {tuple(ids.shape)}, {out_dtype}")
        ids = ids.contiguous()
        k = table.shape[1]
        out = torch.empty(ids.shape[0], k, dtype=out_dtype)
        if self._int8_embedding_rows(table.data_ptr(), table.stride(0), scale.data_ptr(), n, k,
                                     ids.data_ptr(), ids.shape[0], out.data_ptr(),
                                     DTYPE_CODES[out_dtype], torch.get_num_threads()):
            raise ValueError(f"int8_embedding: token ids must lie in [0, {n})")
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU gate: x [N, 2I] -> round(silu(x[:, :I])) * x[:, I:] as a fresh [N, I] tensor
        (torch's rounding in 16-bit dtypes). Raises ValueError on a dtype/layout mismatch."""
        if not rows_ok(x, x.dtype) or x.shape[1] % 2:
            check_rows("x", x, x.dtype)
            raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[1]}")
        rows, width = x.shape
        out = torch.empty(rows, width // 2, dtype=x.dtype)
        status = self._silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, width // 2,
                                    DTYPE_CODES[x.dtype], torch.get_num_threads())
        raise_on(status, "silu_and_mul")
        return out

    def gelu_and_mul(self, x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
        """GeGLU gate (Shazeer 2020): x [N, 2I] -> round(gelu(x[:, :I])) * x[:, I:] as a fresh
        [N, I] tensor of x's dtype (fp32 math, torch's rounding points in 16-bit dtypes).

        Args:
            x: float32/bfloat16/float16 CPU rows with unit stride.
            approximate: ``"tanh"`` (torch's tanh form, HF ``gelu_pytorch_tanh``) or
                ``"none"`` (the exact erf form), as in ``torch.nn.functional.gelu``.

        Raises:
            ValueError: on a dtype/layout mismatch, an odd last dim or another
                ``approximate``.
        """
        if not rows_ok(x, x.dtype) or x.shape[1] % 2:
            check_rows("x", x, x.dtype)
            raise ValueError(f"gelu_and_mul needs an even last dim, got {x.shape[1]}")
        return self._gelu_rows(self._gelu_and_mul, x, x.shape[1] // 2, approximate)

    def gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """GELU (Hendrycks & Gimpel 2016) of rows x [N, D] as a fresh [N, D] tensor of x's
        dtype, computed in fp32 (``F.gelu(x, approximate=approximate)``'s math; the erf
        form's erfc by Numerical Recipes' Chebyshev fit, fractional error < 1.2e-7).

        Raises:
            ValueError: when x is not float32/bfloat16/float16 CPU rows with unit stride, or
                ``approximate`` is not ``"tanh"`` / ``"none"``.
        """
        check_rows("x", x, x.dtype)
        return self._gelu_rows(self._gelu, x, x.shape[1], approximate)

    def _gelu_rows(self, fn, x: torch.Tensor, width: int, approximate: str) -> torch.Tensor:
        """Run ``fn`` (kvflow_gelu or kvflow_gelu_and_mul) over x's rows into [N, width]."""
        code = _GELU_APPROXIMATE.get(approximate)
        if code is None:
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        out = torch.empty(x.shape[0], width, dtype=x.dtype)
        status = fn(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], width, code,
                    DTYPE_CODES[x.dtype], torch.get_num_threads())
        raise_on(status, "gelu")
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
            if t.dtype not in DTYPE_CODES or t.dtype != q.dtype or not t.is_cpu \
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
                              int(is_neox), DTYPE_CODES[q.dtype], torch.get_num_threads())
        if status == 2:
            raise ValueError(f"rotary: positions must lie in [0, {cos_sin_cache.shape[0]})")
        raise_on(status, "rotary")
        return q, k


# torch's approximate= names -> the kernels' codes (csrc/cpu_gelu.c)
_GELU_APPROXIMATE = {"none": 0, "tanh": 1}


def _rms_norm_error(x: torch.Tensor, weight: torch.Tensor,
                    residual: torch.Tensor | None) -> None:
    """Raise the ValueError saying why :meth:`NativeCpuKernels.rms_norm` refuses its operands.

    Raises:
        ValueError: always.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, hidden], got {tuple(x.shape)}")
    check_rows("x", x, weight.dtype)
    hidden = x.shape[1]
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    if residual is not None:
        check_rows("residual", residual, x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    raise ValueError("rms_norm: unsupported operands")
