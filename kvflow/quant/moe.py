"""Quantized Mixture-of-Experts weights: the experts of a ``FusedMoE`` layer in INT8 (W8A16,
per expert and output row) or FP8 (W8A8, per expert and checkpoint tensor, activations per
token), quantized on load from a float checkpoint (``--quantization int8|fp8``).

The layer (``kvflow/layers/moe.py``) keeps routing, placement (TP/EP slices, the per-expert
weight loader) and the all-reduce; a :class:`FusedMoEMethod` owns how the stacked weights
``w13_weight`` [E, 2I, H] / ``w2_weight`` [E, H, I] are stored and multiplied:

1. the float weights load through the layer's own loader (nothing to create);
2. ``process_weights_after_loading(layer)`` quantizes them once;
3. ``apply(layer, hidden, topk_weights, topk_ids)`` runs the routed experts on the grouped
   loop of :func:`kvflow.kernels.moe_ref.grouped_experts` (one call per expert that got
   tokens), each expert's two GEMMs through the scheme's own product: INT8 through
   :func:`kvflow.quant.int8.int8_linear` (kvflow's native INT8 kernel on CPU), FP8 through
   :func:`kvflow.quant.fp8.fp8_linear` (``torch._scaled_mm`` on CUDA, the dequantized
   reference elsewhere).

The scales follow the dense methods (``int8.py``, ``fp8.py``): INT8 ``absmax / 127`` per row of
every expert; FP8 ``absmax / 448`` per expert for each of gate, up and down (gate and up keep
their own scales inside the fused w13, expanded to one per row).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels.moe_ref import grouped_experts
from kvflow.quant.fp8 import fp8_linear, quantize_fp8_per_tensor
from kvflow.quant.int8 import int8_linear, quantize_int8_per_channel
from kvflow.quant.shard_absmax import note_absmax, take_absmax


class FusedMoEMethod(ABC):
    """How one ``FusedMoE`` layer's expert weights are stored and multiplied."""

    name: str = "abstract"
    # True: checkpoint tensors go to :meth:`load_expert` as they are (GGUF's raw blocks),
    # not into the layer's float ``w13_weight`` / ``w2_weight``
    loads_checkpoint: bool = False

    def create_weights(self, layer: nn.Module) -> None:
        """Replace the layer's float weights before loading (called by ``set_quant_method``;
        the methods that quantize float weights keep them)."""

    def load_expert(self, layer: nn.Module, shard_id: str, local_expert: int | None,
                    loaded: torch.Tensor) -> None:
        """Take one checkpoint tensor as it is (methods with :attr:`loads_checkpoint`):
        ``shard_id`` ``"w1"``/``"w3"``/``"w2"`` of expert ``local_expert`` on this rank.

        Raises:
            NotImplementedError: for a method that loads through the float weights.
        """
        raise NotImplementedError(f"{self.name} experts load through the float weights")

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize the loaded float ``w13_weight`` / ``w2_weight`` (once)."""

    def note_loaded(self, layer: nn.Module, shard_id: str, local_expert: int | None,
                    loaded: torch.Tensor) -> None:
        """See one full checkpoint tensor before a tensor-parallel rank slices it (called by
        ``FusedMoE.weight_loader`` when ``tp_size > 1``): ``loaded`` is one expert's
        ``"w1"``/``"w3"`` [I, H] or ``"w2"`` [H, I] (``local_expert`` its index on this rank),
        or with ``local_expert=None`` this rank's experts stacked (``"w13"`` [E, 2I, H],
        ``"w2"`` [E, H, I]), I the full width. Methods whose scales span what TP splits note
        their statistics here (:mod:`kvflow.quant.shard_absmax`)."""

    @abstractmethod
    def expert_linear(self, layer: nn.Module, x: torch.Tensor, which: str,
                      expert: int) -> torch.Tensor:
        """``x [n, K] @ W.T`` for expert ``expert``'s ``which`` ("w13" or "w2") weight, in
        ``x.dtype``."""

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_weights [T, k] float32, topk_ids [T, k] (local expert ids;
        ids >= E are skipped) -> [T, H] in ``hidden.dtype``."""
        def expert_mlp(x: torch.Tensor, expert: int) -> torch.Tensor:
            gate, up = self.expert_linear(layer, x, "w13", expert).chunk(2, dim=-1)
            return self.expert_linear(layer, F.silu(gate) * up, "w2", expert)

        return grouped_experts(hidden, topk_weights, topk_ids, layer.num_local_experts,
                               layer.w2_weight.shape[1], expert_mlp)


def _per_expert(layer: nn.Module, local_expert: int | None,
                stat: torch.Tensor) -> torch.Tensor:
    """``stat`` of one expert ([R]) placed in a zero [E_local, R] (or already stacked)."""
    if local_expert is None:
        return stat
    full = torch.zeros(layer.w13_weight.shape[0], stat.shape[-1])
    full[local_expert] = stat
    return full


def _replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(value, requires_grad=False))


class Int8FusedMoEMethod(FusedMoEMethod):
    """After loading: ``w13_weight`` int8 [E, 2I, H] + ``w13_weight_scale`` float32 [E, 2I],
    ``w2_weight`` int8 [E, H, I] + ``w2_weight_scale`` float32 [E, H]."""

    name = "int8"

    def note_loaded(self, layer: nn.Module, shard_id: str, local_expert: int | None,
                    loaded: torch.Tensor) -> None:
        """Note the full rows' absmax of ``w2`` (TP splits its columns; w1/w3 rows are
        whole on every rank)."""
        if shard_id == "w2":
            note_absmax(layer, "w2", _per_expert(layer, local_expert,
                                                 loaded.float().abs().amax(dim=-1)))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for which in ("w13", "w2"):
            w = getattr(layer, f"{which}_weight").data
            experts, rows, cols = w.shape
            noted = take_absmax(layer, which)
            q, scale = quantize_int8_per_channel(
                w.reshape(experts * rows, cols), None if noted is None else noted.reshape(-1))
            _replace(layer, f"{which}_weight", q.view(experts, rows, cols))
            _replace(layer, f"{which}_weight_scale", scale.view(experts, rows))

    def expert_linear(self, layer: nn.Module, x: torch.Tensor, which: str,
                      expert: int) -> torch.Tensor:
        return int8_linear(x, getattr(layer, f"{which}_weight")[expert],
                           getattr(layer, f"{which}_weight_scale")[expert])


class Fp8FusedMoEMethod(FusedMoEMethod):
    """After loading: ``w13_weight`` / ``w2_weight`` float8_e4m3fn, ``*_weight_scale``
    float32 [E, rows] (per-tensor scales of gate, up and down, one per row)."""

    name = "fp8"

    def note_loaded(self, layer: nn.Module, shard_id: str, local_expert: int | None,
                    loaded: torch.Tensor) -> None:
        """Note the absmax of each whole gate, up and down tensor (one per expert)."""
        absmax = loaded.float().abs()
        if shard_id == "w13":  # stacked [E, 2I, H]: gate rows, then up rows
            stat = torch.stack([h.amax(dim=(1, 2)) for h in absmax.chunk(2, dim=1)], dim=1)
        elif local_expert is None:  # stacked w2 [E, H, I]
            stat = absmax.amax(dim=(1, 2))[:, None]
        else:  # one expert's w1 (gate), w3 (up) or w2 (down)
            stat = torch.zeros(layer.w13_weight.shape[0], 1 if shard_id == "w2" else 2)
            stat[local_expert, 1 if shard_id == "w3" else 0] = absmax.amax()
        note_absmax(layer, "w2" if shard_id == "w2" else "w13", stat)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        inter = layer.w2_weight.shape[2]
        for which, parts in (("w13", (inter, inter)), ("w2", (layer.w2_weight.shape[1],))):
            w = getattr(layer, f"{which}_weight").data
            noted = take_absmax(layer, which)  # [E, shards] of the full tensors, or None
            qs, scales = [], []
            for e, expert in enumerate(w):
                for i, shard in enumerate(expert.split(list(parts))):
                    q, s = quantize_fp8_per_tensor(shard, None if noted is None else noted[e, i])
                    qs.append(q)
                    scales.append(s.expand(shard.shape[0]))
            _replace(layer, f"{which}_weight", torch.cat(qs).view(w.shape))
            _replace(layer, f"{which}_weight_scale", torch.cat(scales).view(w.shape[:2]))

    def expert_linear(self, layer: nn.Module, x: torch.Tensor, which: str,
                      expert: int) -> torch.Tensor:
        return fp8_linear(x, getattr(layer, f"{which}_weight")[expert],
                          getattr(layer, f"{which}_weight_scale")[expert])
