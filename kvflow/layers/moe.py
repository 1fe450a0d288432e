"""Mixture-of-Experts: router top-k, experts stored as stacked tensors, grouped expert MLPs.

A sparse MoE block (Shazeer et al. 2017; Mixtral, Jiang et al., "Mixtral of Experts", 2024,
arXiv:2401.04088) replaces the dense MLP: a linear router scores the ``E`` experts per token,
each token goes to its ``top_k`` experts, each expert is a SwiGLU MLP, and the outputs are
summed with the routing weights. The routing rules (from the HF configs):

* Mixtral: ``softmax(top_k(logits))`` -- computed as softmax over all experts, top-k, then
  renormalized to sum to 1, which is the same thing.
* Qwen2-MoE / Qwen3-MoE: softmax over all experts, top-k, and renormalized only when the
  config's ``norm_topk_prob`` is true (Qwen1.5-MoE: false; Qwen3-30B-A3B: true).

Execution groups tokens by expert instead of looping over tokens: the ``T * top_k`` (token,
expert) pairs are sorted by expert id, the hidden rows are gathered in that order, each expert
multiplies its contiguous slice (a grouped GEMM), and a weighted ``index_add`` scatters the rows
back. ``FusedMoE`` is a :class:`~kvflow.layers.custom_op.CustomOp`: on CUDA one Triton
grouped-GEMM launch covers all experts (``kvflow/kernels/moe.py``); elsewhere (CPU included)
:func:`kvflow.kernels.moe_ref.fused_experts_ref` does one matmul per expert that received tokens.

Expert weights are stacked ``[num_experts, ...]`` and loaded per expert through
``weight_loader(param, tensor, shard_id, expert_id)``, so expert parallelism can later keep a
slice of the expert dimension by ``expert_id``; tensor parallelism shards the intermediate
dimension of every expert (column-parallel w1/w3, row-parallel w2 + all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.kernels.gemm import GemmPathMixin
from kvflow.kernels.moe_ref import fused_experts_ref
from kvflow.layers.custom_op import CustomOp


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing.

    Args:
        router_logits: [T, E] router scores (any float dtype).
        top_k: experts per token.
        renormalize: rescale the k kept probabilities to sum to 1 (Mixtral always; Qwen MoE
            when ``norm_topk_prob``).

    Returns:
        (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64), highest weight first.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(GemmPathMixin, CustomOp):
    """All experts of one MoE layer as two stacked weights, with routing and combine.

    ``forward(hidden [T, H], router_logits [T, E]) -> [T, H]`` (``hidden.dtype``).

    Parameters (per TP rank, ``I_local = intermediate_size // tp_size``):
        w13_weight: [E, 2 * I_local, H] -- each expert's gate (w1) rows, then up (w3) rows.
        w2_weight: [E, H, I_local] -- each expert's down projection.

    Args:
        num_experts: E.
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: each expert's MLP width (HF ``moe_intermediate_size``, or
            ``intermediate_size`` for Mixtral).
        renormalize: see :func:`select_experts`.
        tp_rank / tp_size: tensor-parallel position (the intermediate dim is split).

    Raises:
        ValueError: if ``intermediate_size`` is not divisible by ``tp_size``.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"intermediate_size {intermediate_size} not divisible by "
                             f"tp_size {tp_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.intermediate_size = intermediate_size // tp_size
        inter = self.intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter),
                                      requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        """Copy one checkpoint tensor into the stacked weights.

        Args:
            param: ``w13_weight`` or ``w2_weight``.
            loaded: one expert's full (unsharded) tensor: ``"w1"``/``"w3"`` [I, H] (gate / up),
                ``"w2"`` [H, I]; or, with ``expert_id=None``, all experts stacked as in
                transformers 5 (``"w13"`` [E, 2*I, H], ``"w2"`` [E, H, I]).
            shard_id: ``"w1"``, ``"w3"``, ``"w2"`` or ``"w13"``.
            expert_id: global expert index, or None for a stacked tensor.

        Raises:
            ValueError: for an unknown ``shard_id`` or a shape that does not fit.
        """
        inter, hidden = self.intermediate_size, self.w2_weight.shape[1]
        full = inter * self.tp_size
        expected = {"w1": (full, hidden), "w3": (full, hidden), "w2": (hidden, full),
                    "w13": (2 * full, hidden)}.get(shard_id)
        if expected is None:
            raise ValueError(f"unknown expert shard_id {shard_id!r}")
        if expert_id is None:
            expected = (self.num_experts, *expected)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert weight {shard_id} has shape {tuple(loaded.shape)}, "
                             f"expected {expected}")
        dst = param.data if expert_id is None else param.data[expert_id]
        if shard_id == "w2":  # row-parallel: split the input (intermediate) dim
            src = loaded.narrow(-1, self.tp_rank * inter, inter)
        elif shard_id == "w13":  # stacked gate|up halves, each split by TP
            src = torch.cat([loaded.narrow(-2, self.tp_rank * inter, inter),
                             loaded.narrow(-2, full + self.tp_rank * inter, inter)], dim=-2)
        else:  # w1 (gate) or w3 (up): column-parallel, into the first or second half
            src = loaded.narrow(0, self.tp_rank * inter, inter)
            dst = dst.narrow(0, 0 if shard_id == "w1" else inter, inter)
        dst.copy_(src)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H] in ``hidden.dtype``: route
        (:func:`select_experts`), run the experts with the implementation for hidden's device
        (:class:`~kvflow.layers.custom_op.CustomOp`), all-reduce the TP partial sums."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = self.implementation_for(hidden.device)(hidden, topk_weights, topk_ids)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out)
        return out

    def forward_native(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts in plain torch (:func:`kvflow.kernels.moe_ref.fused_experts_ref`,
        one matmul per expert that got tokens; also kvflow's CPU path, there being no native
        MoE kernel). topk_weights [T, k] float32, topk_ids [T, k] int64."""
        return fused_experts_ref(hidden, self.w13_weight, self.w2_weight, topk_weights,
                                 topk_ids, self.gemm_workspace)

    def forward_cuda(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts on two Triton grouped-GEMM launches
        (:func:`kvflow.kernels.moe.fused_experts`)."""
        from kvflow.kernels.moe import fused_experts

        return fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
