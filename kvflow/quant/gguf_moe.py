"""MoE GGUF experts kept quantized (``--quantization gguf``): each expert's gate, up and down
GGML blocks stay as the file stores them, stacked per layer, and the routed experts multiply
them with the dense GGUF layers' GEMM (:func:`kvflow.quant.gguf.gguf_linear_cpu` on CPU, the
fused dequantize-and-dot kernel at decode; :func:`~kvflow.quant.gguf.gguf_linear`'s tiles
elsewhere), one expert at a time over the tokens routed to it
(:func:`kvflow.kernels.moe_ref.grouped_experts`), as vLLM's GGUF MoE method keeps them.

After loading, a ``FusedMoE`` layer holds ``w13_weight`` uint8 [E, 2I, row_bytes] (gate rows
then up rows, when both have one GGML type; else ``w1_weight`` and ``w3_weight`` [E, I, ...])
and ``w2_weight`` [E, H, row_bytes], with their types in ``layer.gguf_types`` (name -> GGML
type). One stacked tensor has one type, as in the file (``blk.N.ffn_gate_exps`` is one
tensor); a Q4_K_M file's Q6_K down beside Q4_K gate/up keeps both. Experts the file stores
as floats (or in a type without a kept kernel, dequantized by the loader) stay float32
(type ``F32``). ``KVFLOW_GGUF_MOE=dequantized`` (:func:`kvflow.config.gguf_moe_experts_choice`)
dequantizes them at load instead.

Tensor parallelism splits every expert as vLLM does: each rank keeps ``I / tp_size`` gate and
up rows (whole GGML rows) and the matching down columns, which are whole blocks when
``I / tp_size`` is a multiple of the type's block size (32 elements for Q4_0..Q8_0, 256 for
the K-quants; otherwise the load is refused); the layer's all-reduce sums the partial down
outputs. The float stacks of ``FusedMoE`` are never allocated under this method.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels.gguf_dequant import F32, row_elements
from kvflow.kernels.moe_ref import grouped_experts
from kvflow.quant import gguf_tp
from kvflow.quant.gguf import as_kept, gguf_cpu_kernels, gguf_linear, gguf_linear_cpu
from kvflow.quant.moe import FusedMoEMethod

_SHARDS = ("w1", "w3", "w2")  # gate, up, down


def _columns(tensor: torch.Tensor, ggml_type: int) -> int:
    """Input features of one expert's kept rows (blocks or float32)."""
    return tensor.shape[1] if ggml_type == F32 else row_elements(tensor.shape[1], ggml_type)


class GGUFFusedMoEMethod(FusedMoEMethod):
    """Experts as GGML blocks; see the module docstring for the parameters after loading."""

    name = "gguf"
    loads_checkpoint = True

    def create_weights(self, layer: nn.Module) -> None:
        """Drop the layer's float weights (placeholders keep the names the loader fills)."""
        for name in ("w13_weight", "w2_weight"):
            placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            placeholder.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
            setattr(layer, name, placeholder)
        layer.gguf_experts = {shard: {} for shard in _SHARDS}

    def load_expert(self, layer: nn.Module, shard_id: str, local_expert: int | None,
                    loaded: torch.Tensor) -> None:
        """Keep one expert's tensor: raw blocks uint8 [rows, row_bytes] tagged ``ggml_type``
        (``kvflow.models.gguf_loader``), or a float [rows, cols].

        With tensor parallelism (``layer.tp_size`` > 1) ``loaded`` is the full expert and
        this rank keeps its slice, as vLLM shards experts: gate/up (w1/w3) by output rows
        (whole GGML rows), down (w2) by input columns, whole blocks of the type's 32 or 256
        elements (the layer's all-reduce sums the partial down outputs).

        Raises:
            ValueError: for a stacked tensor or a ``shard_id`` other than w1/w3/w2, rows or
                columns that do not fit the layer, or a down column split that would cut
                blocks (``intermediate_size / tp_size`` not a multiple of the block size).
        """
        if shard_id not in _SHARDS:
            raise ValueError(f"unknown GGUF expert shard_id {shard_id!r} (w1, w3 or w2)")
        if local_expert is None:
            raise ValueError(f"GGUF experts load one expert at a time, not a stacked "
                             f"{shard_id} tensor")
        tensor, ggml_type = as_kept(loaded)
        hidden, full = layer.hidden_size, layer.intermediate_size * layer.tp_size
        rows, cols = (hidden, full) if shard_id == "w2" else (full, hidden)
        if tensor.dim() != 2 or (tensor.shape[0], _columns(tensor, ggml_type)) != (rows, cols):
            raise ValueError(f"expert weight {shard_id} holds {tuple(tensor.shape)} "
                             f"(GGML type {ggml_type}); expected {rows} rows of {cols} values")
        if layer.tp_size > 1:
            tensor = _tp_slice(layer, shard_id, tensor, ggml_type)
        layer.gguf_experts[shard_id][local_expert] = (tensor, ggml_type)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Stack each shard's experts, gate and up into one ``w13_weight`` where they share a
        type.

        Raises:
            ValueError: when an expert is missing or the experts of one shard differ in type.
        """
        (gate, gate_t), (up, up_t), down = (_stacked(layer, s) for s in _SHARDS)
        del layer.gguf_experts
        if gate_t == up_t and gate.shape[2] == up.shape[2]:
            kept = {"w13_weight": (torch.cat([gate, up], dim=1), gate_t)}
        else:
            kept = {"w1_weight": (gate, gate_t), "w3_weight": (up, up_t)}
        kept["w2_weight"] = down
        del layer.w13_weight, layer.w2_weight
        for name, (tensor, _) in kept.items():
            setattr(layer, name, nn.Parameter(tensor, requires_grad=False))
        layer.gguf_types = {name: ggml_type for name, (_, ggml_type) in kept.items()}
        layer._quant_param_names = tuple(kept)

    def expert_linear(self, layer: nn.Module, x: torch.Tensor, which: str,
                      expert: int) -> torch.Tensor:
        """``x [n, K] @ W.T`` in float32 for expert ``expert``'s ``which`` ("w13": gate
        then up columns; "w2") weight."""
        kernels = gguf_cpu_kernels() if x.device.type == "cpu" else None
        rows = x.float()
        names = ("w2_weight",) if which == "w2" else \
            ("w13_weight",) if "w13_weight" in layer.gguf_types else ("w1_weight", "w3_weight")
        outs = []
        for name in names:
            raw, ggml_type = getattr(layer, name)[expert], layer.gguf_types[name]
            outs.append(gguf_linear(rows, raw, ggml_type) if kernels is None
                        else gguf_linear_cpu(rows, raw, ggml_type, kernels))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_weights [T, k] float32, topk_ids [T, k] (local ids; ids >= E
        skipped) -> [T, H] in ``hidden.dtype``; each expert's SwiGLU runs in float32."""
        def expert_mlp(x: torch.Tensor, expert: int) -> torch.Tensor:
            gate, up = self.expert_linear(layer, x, "w13", expert).chunk(2, dim=-1)
            return self.expert_linear(layer, F.silu(gate) * up, "w2", expert).to(x.dtype)

        return grouped_experts(hidden, topk_weights, topk_ids, layer.num_local_experts,
                               layer.hidden_size, expert_mlp)


def _tp_slice(layer: nn.Module, shard_id: str, tensor: torch.Tensor,
              ggml_type: int) -> torch.Tensor:
    """This TP rank's part of one full expert tensor: ``I_local = intermediate_size`` rows of
    w1/w3, or the w2 columns ``[rank * I_local, (rank + 1) * I_local)`` as whole blocks.

    Raises:
        ValueError: when ``I_local`` is not a multiple of the type's block size.
    """
    if shard_id != "w2":
        inter = layer.intermediate_size
        return gguf_tp.rows(tensor, layer.tp_rank * inter, inter)
    return gguf_tp.columns(tensor, ggml_type, layer.tp_rank, layer.tp_size,
                           "expert down weights", "intermediate_size")


def _stacked(layer: nn.Module, shard_id: str) -> tuple[torch.Tensor, int]:
    """[E, rows, row_bytes] (or float32 [E, rows, cols]) of one shard's experts, and the type.

    Raises:
        ValueError: when an expert is missing or the experts differ in type or row size.
    """
    got = layer.gguf_experts[shard_id]
    missing = [e for e in range(layer.num_local_experts) if e not in got]
    if missing:
        raise ValueError(f"GGUF expert weights {shard_id} of experts {missing[:8]} are "
                         "missing from the checkpoint")
    parts = [got[e] for e in range(layer.num_local_experts)]
    kinds = {(t, p.shape[1]) for p, t in parts}
    if len(kinds) != 1:
        raise ValueError(f"GGUF experts' {shard_id} weights differ in GGML type or row size "
                         f"({sorted(kinds)}); kvflow stacks one type per layer")
    return torch.stack([p for p, _ in parts]), parts[0][1]
