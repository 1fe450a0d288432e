"""Python wrapper of the native batched multi-LoRA kernel (``csrc/cpu_lora.c``): every adapted
row of a step times its own adapter's A then B, in one C call whatever the mix of adapters, each
row's adapter slot read from an int32 buffer (the CPU step graphs record that buffer's address,
so a step with another mix replays the same program). A mixin of
:class:`kvflow.kernels.cpu_native.NativeCpuKernels`; the torch reference is
:func:`kvflow.lora.layers.grouped_lora`.
"""

from __future__ import annotations

import ctypes

import torch

from kvflow.kernels.cpu_native_common import DTYPE_CODES, bind, c_int, i64, ptr, rows_ok


class LoRAKernels:
    """The grouped LoRA matmul of :class:`kvflow.lora.layers.LoRALinear` on CPU."""

    def _bind_lora(self, lib: ctypes.CDLL) -> None:
        self._lora = bind(lib, "kvflow_lora", c_int,
                          [ptr, i64, c_int, ptr, i64, c_int, ptr, ptr, c_int, ptr, i64, i64, i64,
                           i64, i64, c_int])

    def lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
             lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``y[t] += (x[t] A[s]^T) B[s]^T`` for every row ``t`` of slot ``s = slots[t] >= 0``
        (in place), fp32 math, the delta rounded to ``y``'s dtype once and added as
        ``y.add_(delta.to(y.dtype))`` does.

        Args:
            y: [T, out] fp32/bf16/fp16, unit-stride rows (updated and returned).
            x: [T, in] fp32/bf16/fp16, unit-stride rows.
            lora_a: fp32 [max_loras, R, in], contiguous.
            lora_b: fp32 [max_loras, out, R] (scaling folded in), contiguous or the
                transpose of a contiguous [max_loras, R, out] (``lora_b.transpose(1, 2)``
                contiguous: what :class:`kvflow.lora.layers.LoRALinear` keeps on CPU; the
                expand then accumulates whole vectors of outputs, no horizontal sums).
            slots: int32 [T], contiguous: each row's slot, -1 for none.

        Raises:
            ValueError: on a dtype, shape or layout the kernel does not take, or a slot
                ``>= max_loras`` (nothing is written then).
            MemoryError: when the kernel's scratch could not be allocated.
        """
        _check(y, x, lora_a, lora_b, slots)
        max_loras, rank, in_features = lora_a.shape
        status = self._lora(y.data_ptr(), y.stride(0), DTYPE_CODES[y.dtype], x.data_ptr(),
                            x.stride(0), DTYPE_CODES[x.dtype], lora_a.data_ptr(),
                            lora_b.data_ptr(), int(not lora_b.is_contiguous()),
                            slots.data_ptr(), y.shape[0], in_features,
                            y.shape[1], rank, max_loras, torch.get_num_threads())
        if status == 2:
            raise ValueError(f"lora: a slot in slots is >= max_loras={max_loras}")
        if status:
            raise MemoryError("native lora could not allocate its scratch")
        return y


def _check(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
           slots: torch.Tensor) -> None:
    """Raise ValueError unless the operands fit :meth:`LoRAKernels.lora` (one test on the
    hot path, the details only when it fails)."""
    if rows_ok(y, y.dtype) and rows_ok(x, x.dtype) and lora_a.dtype == lora_b.dtype \
            == torch.float32 and lora_a.is_contiguous() and _b_layout_ok(lora_b) \
            and lora_a.dim() == lora_b.dim() == 3 and slots.dtype == torch.int32 \
            and slots.is_contiguous() and slots.shape == (y.shape[0],) \
            and x.shape[0] == y.shape[0] and lora_a.shape[2] == x.shape[1] \
            and lora_b.shape == (lora_a.shape[0], y.shape[1], lora_a.shape[1]) \
            and slots.is_cpu and lora_a.is_cpu and lora_b.is_cpu:
        return
    if not (rows_ok(y, y.dtype) and rows_ok(x, x.dtype)):
        raise ValueError(f"lora: x and y must be 2-D CPU float32/bfloat16/float16 tensors with "
                         f"unit-stride rows, got x {x.dtype} {tuple(x.shape)}, y {y.dtype} "
                         f"{tuple(y.shape)}")
    if lora_a.dtype != torch.float32 or lora_b.dtype != torch.float32 or lora_a.dim() != 3 \
            or not (lora_a.is_contiguous() and _b_layout_ok(lora_b)):
        raise ValueError(f"lora: lora_a and lora_b must be 3-D float32 tensors, lora_a "
                         f"contiguous, lora_b contiguous or the transpose (dims 1, 2) of a "
                         f"contiguous tensor, got "
                         f"{lora_a.dtype} {tuple(lora_a.shape)}, {lora_b.dtype} "
                         f"{tuple(lora_b.shape)}")
    if slots.dtype != torch.int32 or not slots.is_contiguous() or slots.shape != (y.shape[0],):
        raise ValueError(f"lora: slots must be a contiguous int32 [T] tensor with T = "
                         f"{y.shape[0]} rows of y, got {slots.dtype} {tuple(slots.shape)}")
    raise ValueError(f"lora: shapes do not chain: x {tuple(x.shape)}, lora_a "
                     f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, y {tuple(y.shape)}")


def _b_layout_ok(lora_b: torch.Tensor) -> bool:
    """Whether ``lora_b`` (3-D) is contiguous or the (1, 2)-transpose of a contiguous tensor."""
    return lora_b.dim() == 3 and (lora_b.is_contiguous()
                                  or lora_b.transpose(1, 2).is_contiguous())
