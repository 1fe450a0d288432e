"""Qwen MoE: Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B,
Qwen3-235B-A22B), on the sparse-MoE decoder of ``kvflow/models/mixtral.py``.

From the HF configs (``Qwen2MoeConfig`` / ``Qwen3MoeConfig``): ``num_experts`` experts of width
``moe_intermediate_size``, top ``num_experts_per_tok``, softmax routing renormalized only when
``norm_topk_prob``. A layer is sparse unless it is listed in ``mlp_only_layers`` or
``(layer_idx + 1) % decoder_sparse_step != 0``; the others keep a dense MLP of width
``intermediate_size``. Qwen2-MoE adds a shared expert of width
``shared_expert_intermediate_size`` whose output is scaled by ``sigmoid(shared_expert_gate(x))``
and has q/k/v bias (``attention_bias_for``); Qwen3-MoE has no shared expert, per-head q/k RMSNorm and no
bias (``attention_bias``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvflow.distributed.parallel_state import ParallelState
from kvflow.models.llama import AttentionBias, LlamaForCausalLM
from kvflow.models.mixtral import SparseMoeBlock, SparseMoeForCausalLM, gated_mlp


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether HF's Qwen MoE decoder layer ``layer_idx`` uses the sparse MoE block."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class Qwen2MoeForCausalLM(SparseMoeForCausalLM):
    """Qwen2-MoE: q/k/v bias, routed experts plus a sigmoid-gated shared expert."""

    @classmethod
    def attention_bias_for(cls, config: Any) -> AttentionBias:
        return AttentionBias(qkv=bool(getattr(config, "qkv_bias", True)), o=False)

    def make_mlp(self, config: Any, layer_idx: int, parallel: ParallelState) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return gated_mlp(config, config.intermediate_size, parallel)
        return SparseMoeBlock(config, config.num_experts, config.moe_intermediate_size,
                              bool(config.norm_topk_prob),
                              getattr(config, "shared_expert_intermediate_size", 0) or 0,
                              parallel)


    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; with ``shared_expert_intermediate_size`` 0, skip the shared
        expert transformers saves anyway: its empty gate/up/down tensors (width 0) and its
        ``shared_expert_gate`` [1, hidden], which only scales that expert's zero output
        (kvflow builds neither). Returns the names of loaded parameters.

        Raises:
            ValueError: for a checkpoint tensor that matches no parameter.
        """
        if getattr(self.config, "shared_expert_intermediate_size", 0):
            return super().load_weights(weights)

        def without_shared_expert() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if (".mlp.shared_expert." in name and tensor.numel() == 0) or \
                        ".mlp.shared_expert_gate." in name:
                    continue
                yield name, tensor

        return super().load_weights(without_shared_expert())


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: q/k RMSNorm, no q/k/v bias, no shared expert."""

    qk_norm = True

    @classmethod
    def attention_bias_for(cls, config: Any) -> AttentionBias:
        return LlamaForCausalLM.attention_bias_for(config)
