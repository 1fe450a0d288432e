"""Mixture-of-Experts: router top-k, experts stored as stacked tensors, grouped expert MLPs.

A sparse MoE block (Shazeer et al. 2017; Mixtral, Jiang et al., "Mixtral of Experts", 2024,
arXiv:2401.04088) replaces the dense MLP: a linear router scores the ``E`` experts per token,
each token goes to its ``top_k`` experts, each expert is a SwiGLU MLP, and the outputs are
summed with the routing weights. The routing rules of each model family (Mixtral, Qwen-MoE,
DeepSeek's grouped top-k) are in :mod:`kvflow.layers.moe_routing`.

Execution groups tokens by expert instead of looping over tokens: the ``T * top_k`` (token,
expert) pairs are sorted by expert id, the hidden rows are gathered in that order, each expert
multiplies its contiguous slice (a grouped GEMM), and a weighted ``index_add`` scatters the rows
back. ``FusedMoE`` is a :class:`~kvflow.layers.custom_op.CustomOp`: on CUDA one Triton
grouped-GEMM launch covers all experts (``kvflow/kernels/moe.py``); elsewhere (CPU included)
:func:`kvflow.kernels.moe_ref.fused_experts_ref` does one matmul per expert that received tokens.

Expert weights are stacked ``[num_experts, ...]`` and loaded per expert through
``weight_loader(param, tensor, shard_id, expert_id)``. Tensor parallelism shards the
intermediate dimension of every expert (column-parallel w1/w3, row-parallel w2 + all-reduce).
Expert parallelism instead places whole experts by id (:func:`expert_range`: rank ``r`` of
``n`` holds a contiguous run of ``E / n``); the hidden states are the same on every rank of
the EP group (the TP group of the attention layers), so each rank runs its local experts on the
(token, expert) pairs routed to them and one all-reduce over the EP group combines them (the
all-gather of the dispatch is a no-op and the reduce-scatter + all-gather of the combine is
that all-reduce).

Quantized experts (``--quantization int8|fp8``) hang off ``set_quant_method``: a
:class:`~kvflow.quant.moe.FusedMoEMethod` quantizes the loaded stacked weights and runs the
routed experts itself; routing, placement and the all-reduce stay here.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.comm import CommGroup
from kvflow.kernels.gemm import GemmPathMixin
from kvflow.kernels.moe_ref import fused_experts_ref
from kvflow.layers.custom_op import CustomOp
from kvflow.layers.linear import require_group
from kvflow.layers.moe_routing import (
    GroupedTopKRouting,
    expert_range,
    select_experts,
)
from kvflow.quant.moe import FusedMoEMethod


class FusedMoE(GemmPathMixin, CustomOp):
    """All experts of one MoE layer as two stacked weights, with routing and combine.

    ``forward(hidden [T, H], router_logits [T, E]) -> [T, H]`` (``hidden.dtype``).

    Parameters (per TP rank, ``I_local = intermediate_size // tp_size``):
        w13_weight: [E, 2 * I_local, H] -- each expert's gate (w1) rows, then up (w3) rows.
        w2_weight: [E, H, I_local] -- each expert's down projection.

    Both are built on the meta device (shapes, no memory) and allocated in the build-time
    default dtype and device by :meth:`materialize_float_weights` (the first float load, or
    the model loader once the quantization methods are set); a method that takes checkpoint
    tensors as they are (GGUF blocks) replaces them without the float stacks ever existing.

    Args:
        num_experts: E.
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: each expert's MLP width (HF ``moe_intermediate_size``, or
            ``intermediate_size`` for Mixtral).
        renormalize: see :func:`select_experts`.
        tp_rank / tp_size / tp_group: tensor-parallel position (the intermediate dim is split)
            and the group that sums the partial outputs.
        ep_group: with expert parallelism, the EP group (then ``tp_size`` must be 1): this
            rank holds experts :func:`expert_range` and the group sums the outputs.
        routing: DeepSeek's grouped routing instead of :func:`select_experts` (``top_k`` and
            ``renormalize`` are then the routing's); with noaux_tc the layer holds the
            ``e_score_correction_bias`` [E] float32 parameter (all E experts: routing is global)
            that the routing reads.

    Raises:
        ValueError: if ``intermediate_size`` is not divisible by ``tp_size``, the experts not
            by the EP size, ``top_k`` is not in ``[1, num_experts]``, the routing does not fit
            the experts (:meth:`GroupedTopKRouting.check_experts`), or both TP and EP split
            the layer.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: CommGroup | None = None, ep_group: CommGroup | None = None,
                 routing: GroupedTopKRouting | None = None) -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"intermediate_size {intermediate_size} not divisible by "
                             f"tp_size {tp_size}")
        if ep_group is not None and tp_size > 1:
            raise ValueError("a MoE layer is split by experts (EP) or by width (TP), not both")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE num_experts_per_tok={top_k} must be between 1 and the "
                             f"layer's {num_experts} experts")
        if routing is not None:
            routing.check_experts(num_experts)
        self.routing, self.e_score_correction_bias = routing, None
        if routing is not None and routing.uses_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.ep_group = ep_group
        ep_rank, ep_size = (ep_group.rank, ep_group.world_size) if ep_group else (0, 1)
        self.expert_start, expert_end = expert_range(num_experts, ep_rank, ep_size)
        self.num_local_experts = expert_end - self.expert_start
        self.intermediate_size = intermediate_size // tp_size
        self.hidden_size = hidden_size
        # the float stacks are shapes only (meta) until a float load or the model loader
        # allocates them here (materialize_float_weights): GGUF's kept blocks never need them
        self.float_device = torch.get_default_device()
        self.float_dtype = torch.get_default_dtype()
        self._set_float_weights("meta")
        self.quant_method: FusedMoEMethod | None = None  # None: float experts (below)

    def _set_float_weights(self, device: torch.device | str) -> None:
        """(Re)create ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] on ``device``."""
        e, inter, hidden = self.num_local_experts, self.intermediate_size, self.hidden_size
        for name, shape in (("w13_weight", (e, 2 * inter, hidden)),
                            ("w2_weight", (e, hidden, inter))):
            param = nn.Parameter(torch.empty(shape, dtype=self.float_dtype, device=device),
                                 requires_grad=False)
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            setattr(self, name, param)

    def materialize_float_weights(self) -> None:
        """Allocate the float stacks (uninitialized, in the dtype and on the device that were
        the defaults when the layer was built) unless they exist or the quantization method
        takes checkpoint tensors as they are (``FusedMoEMethod.loads_checkpoint``: GGUF's
        kept experts, whose float stacks are never allocated). The first float
        :meth:`weight_loader` call does this; the model loader calls it for every layer
        after the quantization methods are set, before loading."""
        if self.quant_method is not None and self.quant_method.loads_checkpoint:
            return
        if self.w13_weight.is_meta:
            self._set_float_weights(self.float_device)

    def set_quant_method(self, method: FusedMoEMethod) -> None:
        """Quantize the experts with ``method`` (``kvflow/quant/moe.py``; call before loading):
        the float weights still load through :meth:`weight_loader`, the method converts them
        after loading and runs the experts (GGUF's method instead takes the checkpoint's
        blocks as they are: ``FusedMoEMethod.loads_checkpoint``, and the float stacks are
        never allocated)."""
        self.quant_method = method
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        """Copy one checkpoint tensor into the stacked weights.

        Args:
            param: ``w13_weight`` or ``w2_weight``.
            loaded: one expert's full (unsharded) tensor: ``"w1"``/``"w3"`` [I, H] (gate / up),
                ``"w2"`` [H, I]; or, with ``expert_id=None``, all experts stacked as in
                transformers 5 (``"w13"`` [E, 2*I, H], ``"w2"`` [E, H, I]).
            shard_id: ``"w1"``, ``"w3"``, ``"w2"`` or ``"w13"``.
            expert_id: global expert index, or None for a stacked tensor. With expert
                parallelism, experts held by other ranks are skipped (and a stacked tensor
                contributes only this rank's experts).

        A method that takes checkpoint tensors as they are (GGUF blocks,
        ``FusedMoEMethod.loads_checkpoint``) gets this rank's experts instead.

        Raises:
            ValueError: for an unknown ``shard_id``, an ``expert_id`` outside the layer, or a
                shape that does not fit.
        """
        if self.quant_method is not None and self.quant_method.loads_checkpoint:
            local = self._local_expert(expert_id)
            if local != -1:
                self.quant_method.load_expert(self, shard_id, local, loaded)
            return
        inter, full = self.intermediate_size, self.intermediate_size * self.tp_size
        self._check_float_shape(loaded, shard_id, expert_id)
        local = self._local_expert(expert_id)
        if local == -1:
            return  # another expert-parallel rank holds this expert
        self.materialize_float_weights()
        param = self.w2_weight if shard_id == "w2" else self.w13_weight  # may have been meta
        if expert_id is None:
            loaded = loaded.narrow(0, self.expert_start, self.num_local_experts)
        if self.quant_method is not None and self.tp_size > 1:  # full tensor, before the slice
            self.quant_method.note_loaded(self, shard_id, local, loaded)
        dst = param.data if local is None else param.data[local]
        if shard_id == "w2":  # row-parallel: split the input (intermediate) dim
            src = loaded.narrow(-1, self.tp_rank * inter, inter)
        elif shard_id == "w13":  # stacked gate|up halves, each split by TP
            src = torch.cat([loaded.narrow(-2, self.tp_rank * inter, inter),
                             loaded.narrow(-2, full + self.tp_rank * inter, inter)], dim=-2)
        else:  # w1 (gate) or w3 (up): column-parallel, into the first or second half
            src = loaded.narrow(0, self.tp_rank * inter, inter)
            dst = dst.narrow(0, 0 if shard_id == "w1" else inter, inter)
        dst.copy_(src)

    def _check_float_shape(self, loaded: torch.Tensor, shard_id: str,
                           expert_id: int | None) -> None:
        """Raise ValueError for an unknown ``shard_id`` or a float tensor of the wrong shape
        (see :meth:`weight_loader`)."""
        full, hidden = self.intermediate_size * self.tp_size, self.hidden_size
        expected = {"w1": (full, hidden), "w3": (full, hidden), "w2": (hidden, full),
                    "w13": (2 * full, hidden)}.get(shard_id)
        if expected is None:
            raise ValueError(f"unknown expert shard_id {shard_id!r}")
        if expert_id is None:
            expected = (self.num_experts, *expected)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert weight {shard_id} has shape {tuple(loaded.shape)}, "
                             f"expected {expected}")

    def _local_expert(self, expert_id: int | None) -> int | None:
        """This rank's index of global expert ``expert_id`` (None for a stacked tensor), -1
        when another expert-parallel rank holds it.

        Raises:
            ValueError: for an ``expert_id`` outside the layer.
        """
        if expert_id is None:
            return None
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert_id {expert_id} is outside [0, {self.num_experts})")
        local = expert_id - self.expert_start
        return local if 0 <= local < self.num_local_experts else -1

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H] in ``hidden.dtype``: route
        (:func:`select_experts`), run the experts with the implementation for hidden's device
        (:class:`~kvflow.layers.custom_op.CustomOp`), then sum the ranks' partial outputs over
        the TP group (each rank ran a slice of every expert) or the EP group (each rank ran
        its own experts).

        Raises:
            RuntimeError: when ``tp_size > 1`` and the layer was built without a ``tp_group``,
                or float experts were never loaded nor allocated.
        """
        topk_weights, topk_ids = self.select_experts(router_logits)
        if self.ep_group is not None and self.ep_group.world_size > 1:
            topk_weights, topk_ids = self._local_routes(topk_weights, topk_ids)
        if self.quant_method is not None:
            out = self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        elif self.w13_weight.is_meta:
            raise RuntimeError("FusedMoE's float experts were never loaded (weight_loader) "
                               "or allocated (materialize_float_weights)")
        else:
            out = self.implementation_for(hidden.device)(hidden, topk_weights, topk_ids)
        if self.tp_size > 1:
            out = require_group(self.tp_group, self.tp_size).all_reduce(out)
        elif self.ep_group is not None:
            out = self.ep_group.all_reduce(out)
        return out

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64) by the
        layer's routing (:class:`GroupedTopKRouting`) or, by default, :func:`select_experts`."""
        if self.routing is not None:
            return self.routing.select(router_logits, self.e_score_correction_bias)
        return select_experts(router_logits, self.top_k, self.renormalize)

    def _local_routes(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids [T, k] -> this rank's local ids; a (token, expert) pair routed to
        another rank gets weight 0 and the id ``num_local_experts`` (no expert: skipped)."""
        local = topk_ids - self.expert_start
        here = (local >= 0) & (local < self.num_local_experts)
        return (torch.where(here, topk_weights, 0.0),
                torch.where(here, local, self.num_local_experts))

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

        # Pairs routed to other EP ranks (id num_local_experts) run on expert 0 with weight 0.
        topk_ids = topk_ids.clamp(max=self.num_local_experts - 1)
        return fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
