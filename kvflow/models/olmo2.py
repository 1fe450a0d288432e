"""OLMo 2 (``Olmo2ForCausalLM``; OLMo 2 technical report, Team OLMo 2024, section 3.1): the
Llama decoder with two changes, as transformers' ``modeling_olmo2.py`` computes them:

* norms *after* attention and MLP, inside the residual branch, and none before them:
  ``h = x + post_attention_layernorm(attn(x))``, ``out = h + post_feedforward_layernorm(mlp(h))``;
* QK-norm over the whole q and k projections (one RMSNorm of width ``heads * head_dim``,
  not one per head as Qwen3's), before RoPE.

Under tensor parallelism each rank holds only its heads of q and k, so the norm's mean square
is summed over the TP group (one all-reduce of a [T, 1] tensor per norm).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.comm import CommGroup
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import (
    AttentionBias,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole attention projection whose heads are split over the TP ranks:
    ``y = x / sqrt(mean(x^2) + eps) * weight``, the mean taken over all ``heads * head_dim``
    values of a token (summed over ``tp_group``), computed in float32 and cast back after the
    weight (OLMo 2's rounding).

    Args:
        full_width: the checkpoint weight's length (all heads' ``heads * head_dim``).
        local_width: this rank's ``heads * head_dim``.
        shard: which ``local_width``-slice of the checkpoint's weight this rank holds (its
            heads' index; for replicated KV heads, the replicated head's).
        eps: the config's ``rms_norm_eps``.
        tp_group: the TP group (a single-rank group: no communication). With replicated KV
            heads every head appears equally often over the ranks, so the mean over
            ``local_width * tp_size`` values is the mean over the distinct heads.
    """

    def __init__(self, full_width: int, local_width: int, shard: int, eps: float,
                 tp_group: CommGroup) -> None:
        super().__init__()
        self.full_width = full_width
        self.local_width, self.shard, self.eps, self.tp_group = local_width, shard, eps, tp_group
        self.weight = nn.Parameter(torch.ones(local_width), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's slice of the full checkpoint weight [heads * head_dim].

        Raises:
            ValueError: when ``loaded``'s shape is not ``(full_width,)``.
        """
        if tuple(loaded.shape) != (self.full_width,):
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not match the "
                             f"projection's ({self.full_width},)")
        param.data.copy_(loaded.narrow(0, self.shard * self.local_width, self.local_width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] (this rank's heads) -> normalized, same shape and dtype."""
        shape, dtype = x.shape, x.dtype
        x = x.reshape(shape[0], -1).float()
        sum_sq = x.pow(2).sum(-1, keepdim=True)
        if self.tp_group.world_size > 1:
            sum_sq = self.tp_group.all_reduce(sum_sq)
        mean_sq = sum_sq / (self.local_width * self.tp_group.world_size)
        return (self.weight * (x * torch.rsqrt(mean_sq + self.eps))).to(dtype).view(shape)


class Olmo2Attention(LlamaAttention):
    """Llama's attention with :class:`ProjectionRMSNorm` as ``q_norm`` / ``k_norm``."""

    def __init__(self, config: Any, layer_idx: int, ctx: AttentionContext,
                 rotary_emb: RotaryEmbedding, bias: AttentionBias, qk_norm: bool,
                 parallel: ParallelState) -> None:
        super().__init__(config, layer_idx, ctx, rotary_emb, bias, False, parallel)
        tp, eps = parallel.tp, config.rms_norm_eps
        qkv = self.qkv_proj
        self.q_norm = ProjectionRMSNorm(qkv.total_num_heads * self.head_dim,
                                        self.num_heads * self.head_dim, tp.rank, eps, tp)
        self.k_norm = ProjectionRMSNorm(qkv.total_num_kv_heads * self.head_dim,
                                        self.num_kv_heads * self.head_dim,
                                        tp.rank // qkv.num_kv_replicas, eps, tp)


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """``h = x + post_attention_layernorm(attn(x))``; ``out = h +
    post_feedforward_layernorm(mlp(h))`` (Llama's fused-residual ``forward`` contract: the
    input and output are ``hidden + residual``)."""

    attention_cls: ClassVar[type[LlamaAttention]] = Olmo2Attention

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        del self.input_layernorm  # OLMo 2 has no norm before attention or MLP
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            hidden = hidden + residual
        attn = self.post_attention_layernorm(self.self_attn(positions, hidden))
        residual = hidden + attn
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 causal LM (same interface as :class:`LlamaForCausalLM`; ``attention_bias``
    applies to all four projections, as in transformers)."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = Olmo2DecoderLayer
