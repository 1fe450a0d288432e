"""The quantization-method interface: how a linear (or embedding) layer stores, loads and
multiplies its weight.

A layer (``kvflow/layers/linear.py``, ``embedding.py``) owns its shape, its tensor-parallel
placement and its bias; a :class:`LinearMethod` owns the weight's representation. The layer
calls, in order:

1. ``create_weights(layer, input_size, output_size, params_dtype)`` -- register the parameters
   (``layer.weight``, scales, ...) for this rank's partition (sizes already divided by TP);
2. ``load(layer, param, loaded, *shard)`` -- per checkpoint tensor; the default hands it to the
   layer's placement loader (TP slice, fused q/k/v or gate/up offsets), so a method whose
   parameters are laid out like the weight's rows needs no loader of its own;
3. ``process_weights_after_loading(layer)`` -- once, after every tensor is in (quantize a float
   weight, repack for a kernel);
4. ``apply(layer, x, bias)`` -- ``x @ W.T (+ bias)``, per call.

A new scheme is a new file with a :class:`LinearMethod` (and, in ``kvflow/quant/__init__.py``,
its name); the layers do not change. The pattern is vLLM's ``QuantizeMethodBase``
(``create_weights`` / ``apply`` / ``process_weights_after_loading``) and gpt-fast's
Linear-swapping quantization handlers.

``apply`` dispatches on the activation's device through :class:`DeviceDispatch`: a method
implements ``apply_native`` (plain torch, correct anywhere: the reference) and may add
``apply_cpu`` / ``apply_cuda`` with library or own kernels.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvflow.platforms import op_dispatch_key


class DeviceDispatch:
    """``apply`` runs ``apply_<platform>`` for the activation's device when the method has one,
    else ``apply_native`` (the choice is cached per device)."""

    def __init__(self) -> None:
        self._impls: dict[torch.device, Callable[..., torch.Tensor]] = {}

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] @ W.T (+ bias [N])`` -> ``[..., N]`` in ``x.dtype``."""
        impl = self._impls.get(x.device)
        if impl is None:
            name = f"apply_{op_dispatch_key(x.device.type)}"
            impl = self._impls[x.device] = getattr(self, name, self.apply_native)
        return impl(layer, x, bias)

    def apply_native(self, layer: nn.Module, x: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """Plain torch on any device (the reference the kernels are tested against).

        Raises:
            NotImplementedError: on a method that does not define it (every method must).
        """
        raise NotImplementedError(f"{type(self).__name__} defines no apply_native")


class LinearMethod(DeviceDispatch, ABC):
    """How one linear layer's weight is stored and multiplied (see the module docstring)."""

    name: str = "abstract"
    # Whether the layer multiplies its plain ``weight`` through ``kernels.gemm.linear`` (so the
    # CPU set-up may pack that weight and drop the plain copy: ``kernels.gemm.on_gemm_path``).
    uses_gemm_path: bool = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        """Register the weight parameters on ``layer`` for a ``[output_size, input_size]``
        partition (this TP rank's sizes) in the model's ``params_dtype``."""

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             *shard: Any) -> None:
        """Place one checkpoint tensor into ``param`` (default: the layer's own loader, which
        takes this rank's slice and the fused-shard offset along the output rows)."""
        layer.weight_loader(param, loaded, *shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after the checkpoint is loaded (default: nothing)."""


def check_stored_dtype(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """A pre-quantized weight must be stored in the dtype its scheme quantizes to (int8,
    float8_e4m3fn): a float tensor there (a dequantized or never-compressed folder) would
    otherwise be cast, scales ignored, into garbage.

    Raises:
        ValueError: naming both dtypes.
    """
    if loaded.dtype != param.dtype:
        raise ValueError(f"stored as {loaded.dtype}, but the checkpoint's quantization_config "
                         f"says this weight is quantized to {param.dtype}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: every parameter and buffer plus the CPU GEMM's packed
    copies (``packed_weight.packed``), which replace the plain weights they were made from.
    Bytes shared by several tensors (a tied LM head, views of one storage) count once: the
    union of the tensors' byte ranges, so the unused tail of a
    :class:`~kvflow.platforms.cpu_memory.HugePageArena` segment, which several weights share,
    is not counted. oneDNN's packed (opaque) tensors count their elements' bytes."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        packed_weight = getattr(module, "packed_weight", None)
        for part in getattr(packed_weight, "parts", (packed_weight,)):  # a RowSplitWeight: 2
            packed = getattr(part, "packed", None)
            if isinstance(packed, torch.Tensor):
                tensors.append(packed)
    spans, opaque = [], {}
    for t in tensors:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        if t.is_mkldnn:  # no storage, no address
            opaque[id(t)] = t.numel() * t.element_size()
            continue
        start = t.data_ptr()
        spans.append((start, start + _extent_bytes(t)))
    return _union_bytes(spans) + sum(opaque.values())


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last one (its strides taken into
    account; ``numel * element_size`` for a contiguous tensor)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _union_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes covered by the union of the [start, end) ranges ``spans``."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


class EmbeddingMethod(ABC):
    """How a vocabulary table (the token embedding, the LM head, or one table serving both
    when tied) is stored, looked up and multiplied."""

    name: str = "abstract"
    # Whether the layer multiplies its plain ``weight`` through ``kernels.gemm.linear`` (so the
    # CPU set-up may pack that weight and drop the plain copy: ``kernels.gemm.on_gemm_path``).
    uses_gemm_path: bool = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        """Register ``layer.weight`` for this rank's ``[num_embeddings, embedding_dim]``
        shard of the vocabulary."""

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Place the full checkpoint table (default: the layer's loader takes this rank's
        vocabulary rows)."""
        layer.weight_loader(param, loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after loading (default: nothing)."""

    @abstractmethod
    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] (local to this shard, in range) -> [T, embedding_dim]."""

    @abstractmethod
    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, embedding_dim] -> float32 [N, num_embeddings] (never rounded to 16
        bits)."""
