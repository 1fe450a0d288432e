"""The one GEMM every projection calls, with two CPU fast paths chosen once after loading.

**Prepacked weights (fp32 on CPU).** ``F.linear`` hands MKL a plain row-major weight, which it
re-packs into its blocked layout on every call; at decode batch sizes that packing costs as much
as the product (the 49,152 x 576 LM head at batch 64 ran at ~40 GFLOP/s). oneDNN can pack a
weight once (``torch.ops.mkldnn._reorder_linear_weight``, the op torch's inductor uses for CPU
weight prepacking) and multiply any batch against it (``_linear_pointwise``): 1.3-2.5x faster
GEMMs at batch 64 on an AVX2 EPYC, same results up to fp32 summation order. vLLM's CPU backend
prepacks its weights with oneDNN for the same reason. Where kvflow's native CPU kernels build,
weights are packed for kvflow's own C GEMM instead (``kernels/csrc/cpu_gemm.c``, a Goto/BLIS
loop nest around a 6-row register-tiled micro-kernel), which matched oneDNN at prefill sizes
and ran decode-sized products (tens of rows) 1.3-2x faster on that EPYC. Which of the two each GEMM
uses is timed per CPU and shape class (:mod:`kvflow.kernels.gemm_select`, ``--cpu-gemm``).

**16-bit models on CPUs without 16-bit matmul units.**

A bf16 (or fp16) GEMM multiplies 16-bit operands and accumulates in fp32, then rounds the result
to 16 bits. Widening a bf16 or fp16 value to fp32 is exact, so running the same product on the
fp32 FMA units gives the same mathematical result (only the summation order differs, as between
any two GEMM libraries). On x86 CPUs without AVX512-BF16/AMX (for example AVX2-only AMD EPYC),
torch's native bf16 GEMM runs 6-10x slower than its fp32 GEMM; widening is the fast way there.
llama.cpp takes the same route for bf16 tensors on CPUs without bf16 dot products.

Weights stay stored in 16 bits (the memory a user chose); each GEMM widens its weight into one
shared fp32 workspace just before the product.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.config import cpu_gemm_choice
from kvflow.kernels.cpu_native import NativeCpuKernels, native_cpu_kernels
from kvflow.platforms.cpu_memory import HugePageArena


class GemmWorkspace:
    """A reusable fp32 buffer that 16-bit weights are widened into, one GEMM at a time.

    Widening into a buffer that already exists is 3-5x faster on CPU than ``weight.float()``,
    which pays for fresh pages on every call. Weights larger than ``max_elements`` are widened
    and multiplied in row chunks, so the buffer never exceeds ``4 * max_elements`` bytes.
    Owned by the model runner; one forward pass uses it at a time.
    """

    def __init__(self, max_elements: int = 1 << 23) -> None:
        if max_elements < 1:
            raise ValueError(f"max_elements must be >= 1, got {max_elements}")
        self.max_elements = max_elements
        self._buffer = torch.empty(0, dtype=torch.float32)

    def rows_per_chunk(self, weight: torch.Tensor) -> int:
        """Output rows of ``weight`` [N, K] widened per chunk (at least one)."""
        return max(1, self.max_elements // max(1, weight.shape[-1]))

    def widen(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as float32 (exact), in the buffer; valid until the next call."""
        n = weight.numel()
        if self._buffer.numel() < n or self._buffer.device != weight.device:
            self._buffer = torch.empty(n, dtype=torch.float32, device=weight.device)
        return self._buffer[:n].view(weight.shape).copy_(weight)


MAX_ONEDNN_BATCH_HINT = 65536  # rows; oneDNN failed from ~9e7 (K=576) on a Zen 4 CPU


class OneDnnPackedWeight:
    """A weight in oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``),
    multiplied with ``_linear_pointwise``; computes in the packed weight's dtype."""

    def __init__(self, weight: torch.Tensor, batch_hint: int) -> None:
        # a hint in the tens of millions (--max-num-seqs 1000000000) overflows oneDNN's
        # descriptors ("could not create a primitive descriptor"); past a few thousand rows
        # the hint is a large batch all the same
        hint = min(max(1, batch_hint), MAX_ONEDNN_BATCH_HINT)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[..., N] in the packed weight's dtype (``out_dtype`` is the caller's to apply)."""
        dtype = self.packed.dtype
        if bias is not None:
            bias = bias.to(dtype)
        return torch.ops.mkldnn._linear_pointwise(x.to(dtype), self.packed, bias, "none", [], "")


class NativePackedWeight:
    """A weight packed for kvflow's C GEMM (``kernels/csrc/cpu_gemm.c``): panels of 16 (32 on
    AVX512) output columns, multiplied by a 6-row register-tiled micro-kernel. fp32 weights,
    fp16 weights widened in registers, bf16 weights widened or (AVX512-BF16) multiplied as bf16
    pairs; accumulation and the result are fp32. With an ``arena`` the packed copy lies in
    it (on huge pages: a decode step streams it), else in a tensor of its own."""

    def __init__(self, weight: torch.Tensor, kernels: NativeCpuKernels,
                 arena: HugePageArena | None = None) -> None:
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        out = None if arena is None else arena.empty(
            kernels.gemm_packed_numel(*weight.shape, weight.dtype), weight.dtype)
        self.packed = kernels.gemm_pack(weight.detach(), out)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[..., N] fp32 sums, or rounded once in the kernel to a 16-bit ``out_dtype``."""
        return self.kernels.gemm(x, self.packed, self.out_features,
                                 None if bias is None else bias.float(),
                                 out_dtype or torch.float32)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] int64 (in ``[0, out_features)``) of the weight, read from the
        panels by :meth:`NativeCpuKernels.gemm_rows`: [T, in_features] in the weight's dtype,
        bit for bit the plain weight's rows (an embedding lookup from a tied LM head's packed
        copy, so the plain table can go).

        Raises:
            ValueError: on an id outside ``[0, out_features)``.
        """
        return self.kernels.gemm_rows(self.packed, self.out_features, self.in_features,
                                      ids.contiguous())


class RowSplitWeight:
    """One weight packed for two kernels (``--cpu-gemm auto``'s
    :class:`~kvflow.kernels.gemm_select.KernelSplit`): calls of up to ``max_small_rows`` rows
    run ``small``, larger ones ``large`` (e.g. kvflow's AMX GEMM for decode batches, oneDNN for
    prefill). Costs a second copy of the weight."""

    def __init__(self, small: OneDnnPackedWeight | NativePackedWeight,
                 large: OneDnnPackedWeight | NativePackedWeight, max_small_rows: int) -> None:
        if max_small_rows < 1:
            raise ValueError(f"max_small_rows must be >= 1, got {max_small_rows}")
        self.small, self.large, self.max_small_rows = small, large, max_small_rows
        self.parts = (small, large)  # both packed copies (weight_bytes counts them)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[..., N]: the chosen kernel's result (its dtype; :func:`linear` converts)."""
        rows = x.numel() // max(1, x.shape[-1])
        return (self.small if rows <= self.max_small_rows else self.large)(x, bias, out_dtype)


PackedWeight = OneDnnPackedWeight | NativePackedWeight | RowSplitWeight


def pack_weight(weight: torch.Tensor, batch_hint: int,
                kernels: NativeCpuKernels | None = None,
                arena: HugePageArena | None = None) -> PackedWeight:
    """``weight`` [N, K] CPU packed once for :func:`linear`'s ``packed`` argument: for
    kvflow's C GEMM when ``kernels`` is given (in ``arena`` when given), else for oneDNN
    (whose packed tensors are its own allocations). ``batch_hint``: typical rows per call
    (oneDNN tunes its layout to it; any count works)."""
    if kernels is not None:
        return NativePackedWeight(weight, kernels, arena)
    return OneDnnPackedWeight(weight, batch_hint)


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
           workspace: GemmWorkspace | None = None, packed: PackedWeight | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x @ weight.T + bias``.

    Args:
        x: [..., K] activations.
        weight: [N, K], same dtype as ``x`` (unused, and may be emptied or None, when
            ``packed`` is given).
        bias: [N] or None.
        workspace: when given and ``x`` is bf16/fp16, run the product on fp32 units (exact
            widening, fp32 accumulation). Ignored for fp32 inputs.
        packed: the weight from :func:`pack_weight`; takes precedence.
        out_dtype: the result's dtype (default ``x.dtype``). ``torch.float32`` with 16-bit
            operands returns the fp32 accumulation itself, never rounded to 16 bits (logits).

    Returns:
        [..., N] in ``out_dtype``.
    """
    out_dtype = out_dtype or x.dtype
    if packed is not None:
        y = packed(x, bias, out_dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)  # .to costs ~1 us even as a no-op
    if x.dtype == torch.float32:
        return F.linear(x, weight, bias).to(out_dtype)
    if workspace is None:
        if out_dtype == x.dtype:
            return F.linear(x, weight, bias)
        return _linear_wide_out(x, weight, bias).to(out_dtype)
    x32 = x.float()
    rows = workspace.rows_per_chunk(weight)
    out = x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype)
    for start in range(0, weight.shape[0], rows):
        chunk = slice(start, start + rows)
        wide_bias = None if bias is None else bias[chunk].float()
        out[..., chunk] = F.linear(x32, workspace.widen(weight[chunk]), wide_bias)
    return out


def _linear_wide_out(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """16-bit ``x @ weight.T (+ bias)`` returned in fp32 without rounding the accumulation:
    ``torch.mm(out_dtype=float32)`` where the device has it (CUDA), else on fp32 operands
    (exact widening; costs a float32 copy of the weight per call, a fallback only)."""
    if x.is_cuda:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.mm(rows, weight.t(), out_dtype=torch.float32)
        out = out if bias is None else out + bias.float()
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


class GemmPathMixin:
    """Modules whose GEMMs go through :func:`linear`, with the CPU fast path set after loading:
    ``gemm_workspace`` (widen 16-bit weights; None = native GEMMs, the default) or
    ``packed_weight`` (fp32 weight packed by :func:`pack_weight`; None = plain)."""

    gemm_workspace: GemmWorkspace | None = None
    packed_weight: PackedWeight | None = None


def on_gemm_path(module: nn.Module) -> bool:
    """Whether ``module`` multiplies its plain ``weight`` through :func:`linear`, so that the
    weight may be packed (and the plain copy dropped): a :class:`GemmPathMixin` module whose
    quantization method, if it has one, says so (``uses_gemm_path``: the unquantized methods).
    A GGUF layer keeping a float tensor beside raw blocks has a 2-D float ``weight`` too, but
    multiplies it itself."""
    method = getattr(module, "quant_method", None)
    return isinstance(module, GemmPathMixin) and getattr(method, "uses_gemm_path", method is None)


def widen_half_gemms(model: nn.Module, workspace: GemmWorkspace) -> int:
    """Route every GEMM module of ``model`` through ``workspace`` (fp32 units).

    Called once after loading, when the platform lacks native matmuls for the model dtype
    (:meth:`kvflow.platforms.base.Platform.has_native_matmul`). Returns the number of modules
    switched.
    """
    switched = 0
    for module in model.modules():
        if isinstance(module, GemmPathMixin):
            module.gemm_workspace = workspace
            switched += 1
    return switched


def cpu_gemm_kernels(choice: str | None = None) -> NativeCpuKernels | None:
    """The native kernels for CPU GEMMs, or None (oneDNN only): when the choice
    (``--cpu-gemm`` value, else ``$KVFLOW_CPU_GEMM``, see :func:`kvflow.config.cpu_gemm_choice`)
    is ``onednn`` or the kernels cannot be built. Raises ValueError on a bad choice."""
    return native_cpu_kernels() if cpu_gemm_choice(choice) != "onednn" else None


def prepack_gemm_weights(model: nn.Module, batch_hint: int,
                         kernels: NativeCpuKernels | None = None,
                         pick: Callable[[torch.Tensor], object] | None = None,
                         dtype: torch.dtype = torch.float32,
                         arena: HugePageArena | None = None) -> Counter[str]:
    """Pack the 2-D ``dtype`` weight of every GEMM module of ``model`` once: for the kernel
    ``pick(weight)`` names ("native": kvflow's C GEMM, needs ``kernels``; "onednn"; or a
    :class:`~kvflow.kernels.gemm_select.KernelSplit` of the two: packed for both, a
    :class:`RowSplitWeight`), by default kvflow's C GEMM when ``kernels`` is given, else
    oneDNN (see :func:`pack_weight`); kvflow's packed copies go into ``arena`` when given.
    Returns how many modules each kernel got.

    Called once after loading on CPU. A module that owns its weight (not one tied to the
    embedding table) keeps only the packed copy: its plain ``weight`` becomes an empty [0, K]
    tensor, so packing costs no memory.
    """
    tied = {id(m.weight) for m in model.modules()  # e.g. the embedding table of a tied LM head
            if not isinstance(m, GemmPathMixin)
            and isinstance(getattr(m, "weight", None), torch.Tensor)}
    counts: Counter[str] = Counter()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not on_gemm_path(module) or not isinstance(weight, torch.Tensor) \
                or weight.dim() != 2 or weight.dtype != dtype or weight.device.type != "cpu" \
                or module.packed_weight is not None:  # e.g. a 16-bit LM head packed for fp32
            continue
        kernel = pick(weight) if pick else ("native" if kernels is not None else "onednn")
        module.packed_weight = _pack_for(weight, batch_hint, kernels, kernel, arena)
        if id(weight) not in tied:
            module.weight = nn.Parameter(weight.new_empty(0, weight.shape[1]),
                                         requires_grad=False)
        counts[str(kernel)] += 1
    return counts


def _pack_for(weight: torch.Tensor, batch_hint: int, kernels: NativeCpuKernels | None,
              kernel: object, arena: HugePageArena | None) -> PackedWeight:
    """``weight`` packed for ``kernel`` ("native", "onednn" or a KernelSplit of the two)."""
    small = getattr(kernel, "small", None)
    if small is not None:
        return RowSplitWeight(_pack_for(weight, batch_hint, kernels, small, arena),
                              _pack_for(weight, batch_hint, kernels, kernel.large, arena),
                              kernel.max_small_rows)
    return pack_weight(weight, batch_hint, kernels if kernel == "native" else None, arena)


def pack_logits_head(head: nn.Module, batch_hint: int,
                     kernels: NativeCpuKernels | None = None,
                     arena: HugePageArena | None = None) -> PackedWeight | None:
    """Pack a 16-bit LM head's weight [vocab, hidden] (CPU) so its logits come out in fp32
    without rounding to 16 bits: for kvflow's C GEMM when ``kernels`` is given (16-bit panels
    widened in registers; in ``arena`` when given), else an fp32 copy for oneDNN; None when neither is possible (the
    head then runs :func:`linear`'s fallback). The plain weight is kept (it is usually the
    embedding table too; :func:`drop_plain_head_weight` frees it where the packed copy can
    serve the lookups). Returns the packed weight, also set as ``head.packed_weight``.
    """
    weight = getattr(head, "weight", None)
    if not on_gemm_path(head) or not isinstance(weight, torch.Tensor) \
            or weight.dim() != 2 or weight.device.type != "cpu" \
            or weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    if kernels is not None:
        head.packed_weight = NativePackedWeight(weight, kernels, arena)
    elif torch.backends.mkldnn.is_available():
        head.packed_weight = OneDnnPackedWeight(weight.float(), batch_hint)
    return head.packed_weight


def drop_plain_head_weight(model: nn.Module, head: nn.Module) -> int:
    """After :func:`pack_logits_head` packed ``head`` for kvflow's C GEMM, free its plain
    [vocab, hidden] weight: the head multiplies the packed copy, and a module of ``model``
    sharing that weight (the embedding of a tied head) looks its rows up in the packed copy
    (:meth:`NativePackedWeight.rows`, through its ``packed_weight``). Both keep an empty
    [0, hidden] ``weight``. Nothing is dropped for a oneDNN-packed head (fp32, opaque: its
    rows cannot be read back). Returns the bytes freed (0 when nothing was)."""
    packed = getattr(head, "packed_weight", None)
    weight = getattr(head, "weight", None)
    if not isinstance(packed, NativePackedWeight) or not isinstance(weight, torch.Tensor) \
            or weight.numel() == 0:
        return 0
    empty = nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)
    for module in model.modules():
        if module is head or getattr(module, "weight", None) is weight:
            module.weight = empty
            module.packed_weight = packed
    return weight.numel() * weight.element_size()
