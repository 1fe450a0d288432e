"""What the native CPU kernels' Python bindings share: the dtype codes the C code takes, the
ctypes argument types, and the operand checks and status handling every wrapper uses
(:mod:`kvflow.kernels.cpu_native` composes the wrappers into ``NativeCpuKernels``).
"""

from __future__ import annotations

import ctypes

import torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

i64, f32, c_int, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


def bind(lib: ctypes.CDLL, name: str, restype, argtypes: list) -> ctypes._CFuncPtr:
    """Entry point ``name`` of ``lib`` with its result and argument types set.

    Raises:
        AttributeError: when the library lacks the symbol (an old or foreign library).
    """
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def rows_ok(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``t`` is a 2-D CPU tensor of ``dtype`` (one the kernels take) with unit-stride
    rows: the hot path's one test (:func:`check_rows` says what is wrong)."""
    return t.dtype == dtype and t.is_cpu and t.dim() == 2 and t.stride(1) == 1 \
        and dtype in DTYPE_CODES


def check_rows(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Check what :func:`rows_ok` tests, naming ``name`` in the error.

    Raises:
        ValueError: when ``t`` is not a 2-D CPU tensor of ``dtype`` with unit-stride rows.
    """
    if t.dtype not in DTYPE_CODES or t.dtype != dtype or t.device.type != "cpu" \
            or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D CPU float32/bfloat16/float16 tensor of dtype "
                         f"{dtype} with unit-stride rows, got {t.dtype} {tuple(t.shape)}")


def gemm_out_code(dtype: torch.dtype) -> int:
    """The kernels' code of a GEMM's output dtype (float32, bfloat16, float16).

    Raises:
        ValueError: on another dtype (the kernels write no other).
    """
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(f"gemm: out_dtype must be float32, bfloat16 or float16, got {dtype}")
    return code


def raise_on(status: int, op: str) -> None:
    """Turn a kernel's nonzero status (its scratch allocation failed) into an exception.

    Raises:
        MemoryError: when ``status`` is nonzero.
    """
    if status:
        raise MemoryError(f"native {op} could not allocate its per-thread scratch")
