"""The LoRA wrapper of a linear layer and the grouped LoRA matmul it runs.

``LoRALinear`` wraps any :class:`~kvflow.layers.linear.LinearBase` (whatever its quantization
method: the base output is ``base(x)``, computed as the base layer always does, and LoRA adds
``(x A^T) B^T`` on top). It holds ``max_loras`` device slots per layer, stacked:
``lora_a [max_loras, S * max_rank, in]`` and ``lora_b [max_loras, out, S * max_rank]`` for a
layer fusing ``S`` checkpoint shards (q/k/v: 3, gate/up: 2). Shard ``s``'s A fills rank rows
``[s * max_rank, s * max_rank + r)`` and its B the same columns of its own output rows, so B is
block-diagonal and one shrink plus one expand matmul serve every shard; rows and columns past
an adapter's rank are zero, which adds exactly nothing. On CPU the slots are fp32 whatever the
model's dtype (a rank-r bf16 matmul there pays ~20 us of set-up, fp32 ~3 us; docs/benchmarks.md,
session 48): the layer's input is converted, and the delta rounded to the output's dtype once.

A batch mixes tokens of several adapters (and of none). The step's
:class:`LoRAMapping` lists the adapted tokens grouped by slot (a stable sort done once per
step, shared by every layer); each layer gathers those rows, runs one shrink and one expand
matmul per slot on a contiguous slice, and adds the result into its output with one
``index_add_`` (a step whose every token runs one slot skips the gather and the scatter) -
the segmented ("SGMV", Chen et al. 2023, Punica) form of a multi-adapter
batch. :class:`GroupedLoRA` dispatches it (:class:`~kvflow.layers.custom_op.CustomOp`): plain
torch (:func:`grouped_lora`) on CPU and elsewhere, two Triton launches on CUDA
(:func:`kvflow.kernels.lora.sgmv_lora`; ``KVFLOW_LORA_KERNEL=torch`` keeps torch there too).
A CPU step graph's steps (:func:`graph_mapping`: each token's slot in a static int32 buffer)
run kvflow's native kernel instead, one C call per layer for every adapter
(``csrc/cpu_lora.c``; ``KVFLOW_CPU_LORA=auto``, the default, times it against torch on this
CPU: :mod:`kvflow.lora.cpu_kernel_choice`), which the graph records and replays whatever the
step's mix of adapters; so do eager steps (prefills) of a row count the choice gives the native
kernel (the mapping then carries the tokens' slots as ``row_slots``). On CPU ``lora_b`` is the transpose of a contiguous
``[max_loras, R, out]`` (each rank row's outputs side by side, for the kernel's expand).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from kvflow.config import lora_kernel_choice
from kvflow.kernels.cpu_native import native_kernels_for
from kvflow.kernels.cpu_native_common import DTYPE_CODES
from kvflow.layers.custom_op import CustomOp
from kvflow.layers.linear import LinearBase
from kvflow.lora.adapter import LoRATarget
from kvflow.lora.sharding import full_input_size, shard_pair, slice_rows


@dataclass
class LoRAMapping:
    """Which tokens of one step run which adapter slot.

    Attributes:
        token_index: int64 [N] the adapted tokens' positions in the step, grouped by slot.
        segments: (slot, start, end) per slot used: ``token_index[start:end]`` run ``slot``.
        segment_table: int32 [S, 3] ``segments`` on the device (the Triton kernel's copy).
        token_slots: int64 [T] (host) each step token's slot, -1 for none: what the mapping
            was made from (``select`` maps a subset of the tokens again).
        whole: every token of the step runs one slot (``token_index`` is ``0..T-1``).
        row_slots: int32 [T] (host) ``token_slots`` where the native CPU kernel reads them (a
            CPU step graph's static buffer, :func:`graph_mapping`, or an eager step's copy);
            None: the torch path.
    """

    token_index: torch.Tensor
    segments: list[tuple[int, int, int]]
    segment_table: torch.Tensor
    token_slots: np.ndarray
    whole: bool = False
    row_slots: torch.Tensor | None = None

    @property
    def max_segment_len(self) -> int:
        """Adapted tokens of the busiest slot."""
        return max(end - start for _, start, end in self.segments)

    def select(self, tokens: torch.Tensor, native: bool | None = None) -> LoRAMapping | None:
        """The mapping of the step tokens ``tokens`` (int64 [T_local], ascending: a
        context-parallel rank's share of a prefill, ``kvflow.attention.cp_split``) when only
        they run, renumbered 0..T_local-1 in that order; None when none of them is adapted.
        ``native``: whether it carries its tokens' slots as ``row_slots`` (the native CPU
        kernel runs it, :func:`with_row_slots`); None: as this mapping does."""
        picked = self.token_slots[tokens.cpu().numpy()]
        mapping = make_mapping(picked, self.segment_table.device)
        if native is None:
            native = self.row_slots is not None
        return with_row_slots(mapping) if native and mapping is not None else mapping


def make_mapping(token_slots: np.ndarray, device: torch.device) -> LoRAMapping | None:
    """A step's mapping from each token's slot (int64 [T], -1: no adapter); None when no
    token has one."""
    adapted = np.flatnonzero(token_slots >= 0)
    if not len(adapted):
        return None
    order = adapted[np.argsort(token_slots[adapted], kind="stable")]
    slots, starts, counts = np.unique(token_slots[order], return_index=True, return_counts=True)
    segments = [(int(s), int(b), int(b + c)) for s, b, c in zip(slots, starts, counts)]
    table = torch.tensor(segments, dtype=torch.int32).to(device)
    whole = len(segments) == 1 and len(adapted) == len(token_slots)  # stable sort: 0..T-1
    return LoRAMapping(torch.from_numpy(order).to(device), segments, table,
                       np.asarray(token_slots, dtype=np.int64), whole)


def with_row_slots(mapping: LoRAMapping) -> LoRAMapping:
    """``mapping`` carrying its tokens' slots as ``row_slots`` (int32 [T], a fresh host copy of
    ``token_slots``): an eager CPU step's mapping that the native kernel (``csrc/cpu_lora.c``)
    runs (a step graph's steps put their own buffer's, :func:`graph_mapping`)."""
    return replace(mapping, row_slots=torch.from_numpy(mapping.token_slots.astype(np.int32)))


def graph_mapping(mapping: LoRAMapping | None, row_slots: torch.Tensor) -> LoRAMapping:
    """The mapping of a step run as a CPU step graph: each token's slot (-1: none) written into
    ``row_slots`` (int32 [T], the graph runner's static buffer, whose address the recorded
    calls keep) and attached, so every LoRA layer runs the native kernel
    (``csrc/cpu_lora.c``) over it. A step with no adapted token (``mapping`` None) gets a
    mapping too, of no segments: its calls then change nothing, and every step of a batch
    size records the same calls whatever its mix of adapters."""
    if mapping is None:
        row_slots.fill_(-1)
        return LoRAMapping(torch.zeros(0, dtype=torch.int64), [],
                           torch.zeros(0, 3, dtype=torch.int32),
                           np.full(row_slots.shape[0], -1, dtype=np.int64), row_slots=row_slots)
    row_slots.copy_(torch.from_numpy(mapping.token_slots))
    return replace(mapping, row_slots=row_slots)


class LoRAContext:
    """The step's :class:`LoRAMapping`, shared by every LoRA layer of one model (per engine,
    not a module global; ``bind`` refuses nesting and always clears).

    Args:
        eager_kernel: rows -> the CPU LoRA kernel (``native`` or ``torch``) an eager step of
            that many rows runs (``LoRAManager.eager_cpu_kernel`` on CPU), what :meth:`select`
            decides a context-parallel rank's share by; None (CUDA, tests): a selected
            mapping takes the bound one's path.
    """

    def __init__(self, eager_kernel: Callable[[int], str] | None = None) -> None:
        self.mapping: LoRAMapping | None = None
        self._bound = False
        self._eager_kernel = eager_kernel

    @contextmanager
    def bind(self, mapping: LoRAMapping | None) -> Iterator[None]:
        """Make ``mapping`` the current step's for the duration of the block.

        Raises:
            RuntimeError: when already bound (nested forward passes).
        """
        if self._bound:
            raise RuntimeError("LoRAContext.bind does not nest")
        self.mapping, self._bound = mapping, True
        try:
            yield
        finally:
            self.mapping, self._bound = None, False

    def use_row_slots(self, row_slots: torch.Tensor) -> None:
        """Inside ``bind``: the bound mapping as a CPU step graph runs it, each token's slot in
        ``row_slots`` (int32 [T], :func:`graph_mapping`).

        Raises:
            RuntimeError: outside ``bind``.
        """
        if not self._bound:
            raise RuntimeError("LoRAContext.use_row_slots needs a bound mapping")
        self.mapping = graph_mapping(self.mapping, row_slots)

    def select(self, tokens: torch.Tensor) -> None:
        """Inside ``bind``: keep only the step tokens ``tokens`` (int64 [T_local], ascending)
        of the bound mapping, renumbered, for a forward pass that runs only them (a
        context-parallel rank's token split); nothing to do without a mapping. The native CPU
        kernel runs them where ``eager_kernel`` gives it ``T_local`` rows, as it would a
        single-process eager step of as many rows."""
        if self.mapping is not None:
            native = None if self._eager_kernel is None \
                else self._eager_kernel(int(tokens.shape[0])) == "native"
            self.mapping = self.mapping.select(tokens, native)


def grouped_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                 lora_b: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """``y[t] += (x[t] A[s]^T) B[s]^T`` for every adapted token ``t`` of slot ``s``.

    The matmuls run in ``lora_a``'s dtype (fp32 slots on CPU, see :class:`LoRALinear`; ``x``
    is converted to it) and the delta is rounded to ``y``'s dtype once. When every token runs
    one slot in order (``mapping.whole``: a batch on one adapter) the rows are neither
    gathered nor scattered: the delta is added to ``y`` directly.

    Args:
        y: [T, out] the base layer's output (updated in place and returned).
        x: [T, in] the layer's input.
        lora_a: [max_loras, R, in]; lora_b: [max_loras, out, R] (scaling folded in).
        mapping: the step's adapted tokens, grouped by slot.
    """
    rows = x if mapping.whole else x.index_select(0, mapping.token_index)
    rows = rows.to(lora_a.dtype)
    if len(mapping.segments) == 1:
        slot = mapping.segments[0][0]
        delta = (rows @ lora_a[slot].T) @ lora_b[slot].T
    else:
        delta = torch.empty(rows.shape[0], y.shape[1], dtype=lora_a.dtype, device=x.device)
        for slot, start, end in mapping.segments:
            shrunk = rows[start:end] @ lora_a[slot].T  # [n, R]
            torch.matmul(shrunk, lora_b[slot].T, out=delta[start:end])
    if mapping.whole:
        return y.add_(delta.to(y.dtype))
    return y.index_add_(0, mapping.token_index, delta.to(y.dtype))


class GroupedLoRA(CustomOp):
    """The grouped LoRA matmul per device: ``forward(y, x, lora_a, lora_b, mapping)`` with
    :func:`grouped_lora`'s arguments and result.

    Args:
        kernel: ``triton`` (the CUDA kernel) or ``torch`` (plain torch on CUDA too); default
            ``$KVFLOW_LORA_KERNEL``, else ``triton``.

    Raises:
        ValueError: on another kernel name.
    """

    def __init__(self, kernel: str | None = None) -> None:
        super().__init__()
        self.kernel = lora_kernel_choice(kernel)

    def forward_native(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                       lora_b: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """Plain torch, one shrink and one expand matmul per slot (:func:`grouped_lora`)."""
        return grouped_lora(y, x, lora_a, lora_b, mapping)

    def forward_cpu(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """The native kernel (``csrc/cpu_lora.c``: one C call for every adapter of the step)
        when the mapping carries per-row slots (a CPU step graph's step, :func:`graph_mapping`,
        or an eager step whose row count the CPU LoRA choice gives the native kernel,
        ``LoRAManager.step_mapping``) and the operands fit it; else plain torch."""
        if mapping.row_slots is not None and x.dim() == y.dim() == 2 and x.stride(-1) == 1 \
                and y.stride(-1) == 1 and lora_a.dtype == torch.float32:
            kernels = native_kernels_for(y)
            if kernels is not None and x.dtype in DTYPE_CODES:
                return kernels.lora(y, x, lora_a, lora_b, mapping.row_slots)
        return self.forward_native(y, x, lora_a, lora_b, mapping)

    def forward_cuda(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """Two Triton launches for every slot (:func:`kvflow.kernels.lora.sgmv_lora`); torch
        when asked for, or when x's dtype is not the slots' or y's rows are strided."""
        if self.kernel == "torch" or x.dtype != lora_a.dtype or y.stride(-1) != 1:
            return self.forward_native(y, x, lora_a, lora_b, mapping)
        from kvflow.kernels.lora import sgmv_lora

        return sgmv_lora(y, x, lora_a, lora_b, mapping.token_index, mapping.segment_table,
                         mapping.max_segment_len)


class LoRALinear(nn.Module):
    """A linear layer plus ``max_loras`` LoRA slots (see the module docstring), sized for
    this tensor-parallel rank's part of each adapter (:mod:`kvflow.lora.sharding`).

    Args:
        base: the wrapped layer (any quantization method).
        max_loras: device slots.
        max_rank: largest rank per shard.
        ctx: the model's LoRAContext (the step's token -> slot mapping).
    """

    def __init__(self, base: LinearBase, max_loras: int, max_rank: int,
                 ctx: LoRAContext) -> None:
        super().__init__()
        self.base, self.ctx, self.max_rank = base, ctx, max_rank
        self.grouped = GroupedLoRA()
        self.slices = slice_rows(base)
        self.shards = {shard: rows.size for shard, rows in self.slices.items()}  # this rank's
        # row-parallel over several ranks: the delta joins the partial sum before the
        # all-reduce (each rank holds its columns of A; see kvflow/lora/sharding.py)
        self.row_parallel = base.tp_dim == 1 and base.tp_size > 1
        self.row_offsets, offset = {}, 0
        for shard, size in self.shards.items():
            self.row_offsets[shard] = offset
            offset += size
        rank_rows = len(self.shards) * max_rank
        device = _device_of(base)
        # fp32 slots on CPU: a rank-r bf16/fp16 matmul there costs ~20 us of set-up each
        # (docs/benchmarks.md, session 48), fp32 ~3 us; the slots are small
        dtype = torch.float32 if device.type == "cpu" else base.params_dtype
        self.register_buffer("lora_a", torch.zeros(max_loras, rank_rows,
                                                   base.input_size_per_partition,
                                                   dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", _zeros_b(max_loras, offset, rank_rows, dtype, device),
                             persistent=False)

    @property
    def target(self) -> LoRATarget:
        """What an adapter must fit: the checkpoint's sizes (input features, output rows per
        shard), whatever part of them this rank holds."""
        shards = {shard: rows.full for shard, rows in self.slices.items()}
        if len(shards) > 1:  # a PEFT module may also target the fused layer as a whole
            shards[None] = sum(shards.values())
        return LoRATarget(full_input_size(self.base), shards)

    def shard_weights(self, weights: dict[Any, tuple[torch.Tensor, torch.Tensor]]
                      ) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's part of one adapter's checked ``(A, B)`` per shard (the whole pairs
        on one rank; see :func:`kvflow.lora.sharding.shard_pair`)."""
        return {shard: shard_pair(self.base, shard, a, b) for shard, (a, b) in weights.items()}

    def set_slot(self, slot: int, weights: dict[Any, tuple[torch.Tensor, torch.Tensor]]
                 ) -> None:
        """Load one adapter's (A, B) per shard into ``slot`` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for shard, (a, b) in weights.items():
            block = 0 if shard is None else list(self.shards).index(shard)
            first, rank = block * self.max_rank, a.shape[0]
            offset = 0 if shard is None else self.row_offsets[shard]
            self.lora_a[slot, first:first + rank].copy_(a)
            self.lora_b[slot, offset:offset + b.shape[0], first:first + rank].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapping = self.ctx.mapping
        if self.row_parallel:  # partial sum + this rank's delta, then one all-reduce
            y = self.base.forward_partial(x)
            if mapping is not None:
                y = self.grouped(y, x, self.lora_a, self.lora_b, mapping)
            return self.base.reduce_partial(y)
        y = self.base(x)
        if mapping is None:
            return y
        return self.grouped(y, x, self.lora_a, self.lora_b, mapping)


def _zeros_b(max_loras: int, out: int, rank_rows: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """Zero B slots, ``[max_loras, out, rank_rows]``: on CPU the transpose of a contiguous
    ``[max_loras, rank_rows, out]`` (each rank row's outputs side by side: the native kernel's
    expand adds whole vectors of them, its calls taking 0.46-0.75x the time of dot products
    over an ``[out, R]`` B's rows at 16-64 rows, and torch's matmul takes ``B[s].T``
    contiguous; docs/benchmarks.md, session 50), contiguous elsewhere (the Triton kernel's
    layout)."""
    if device.type == "cpu":
        return torch.zeros(max_loras, rank_rows, out, dtype=dtype, device=device).transpose(1, 2)
    return torch.zeros(max_loras, out, rank_rows, dtype=dtype, device=device)


def _device_of(module: nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")
