"""Greedy sampling's argmax over a batch of fp32 logits (``csrc/cpu_argmax.c`` on CPU, where
the native kernels build; ``torch.argmax`` elsewhere). Same answer as ``torch.argmax(dim=-1)``:
the first index of each row's largest value, a NaN ranking above every number."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels.cpu_native import native_cpu_kernels

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@functools.cache
def _entry(lib: ctypes.CDLL):
    fn = lib.kvflow_argmax_rows
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _int]
    return fn


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The index of the largest value of each row of ``logits`` [B, V] (any dtype, device or
    layout): int64 [B], equal to ``logits.argmax(dim=-1)``. float32 CPU rows with unit stride
    and V > 0 take the native kernel."""
    kernels = native_cpu_kernels() if logits.is_cpu else None
    if kernels is None or logits.dtype != torch.float32 or logits.dim() != 2 \
            or logits.stride(1) != 1 or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _entry(kernels.lib)(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                        out.data_ptr(), torch.get_num_threads())
    return out
