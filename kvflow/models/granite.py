"""IBM Granite 3.x (``GraniteForCausalLM``): the Llama decoder with four scalar multipliers
(muP-style, as in transformers' ``modeling_granite.py``):

* ``embedding_multiplier`` on the token embeddings (and on prompt embeddings);
* ``residual_multiplier`` on each attention and MLP output before it joins the residual
  stream: ``x + m * attn(norm(x))``, ``h + m * mlp(norm(h))``;
* ``attention_multiplier`` as the softmax scale, in place of ``head_dim ** -0.5``;
* ``logits_scaling`` dividing the logits.

Granite 3.x MoE (``GraniteMoeForCausalLM``, e.g. granite-3.1-3b-a800m) is the same with every
MLP a sparse MoE block (``kvflow/models/mixtral.py``): ``num_local_experts`` experts of width
``intermediate_size``, top ``num_experts_per_tok`` by router logit, their softmax over the top
k only (Mixtral's renormalized routing); the checkpoint stores the experts stacked, gate rows
before up rows (``block_sparse_moe.input_linear`` [E, 2 I, hidden], ``output_linear``
[E, hidden, I]) and the router as ``block_sparse_moe.router.layer``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.embedding import ParallelLMHead
from kvflow.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from kvflow.models.mixtral import MoeDecoderLayer, SparseMoeBlock, SparseMoeForCausalLM


class GraniteAttention(LlamaAttention):
    @staticmethod
    def softmax_scale(config: Any, head_dim: int) -> float:
        """Granite's ``attention_multiplier`` (transformers' default 1.0)."""
        return float(getattr(config, "attention_multiplier", 1.0))


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with the attention and MLP outputs scaled by ``residual_multiplier``
    before each residual add (same ``forward`` contract)."""

    attention_cls: ClassVar[type[LlamaAttention]] = GraniteAttention

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def attention_output(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions, hidden) * self.residual_multiplier

    def mlp_output(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x causal LM (same interface as :class:`LlamaForCausalLM`; the logits of
    ``compute_logits`` are divided by ``logits_scaling``)."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = GraniteDecoderLayer

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(config, ctx, parallel)
        self.model.embed_scale = float(getattr(config, "embedding_multiplier", 1.0))
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    def compute_logits(self, hidden: torch.Tensor,
                       head: ParallelLMHead | None = None) -> torch.Tensor:
        """hidden [N, hidden_size] -> [N, vocab_size] float32, divided by ``logits_scaling``."""
        return super().compute_logits(hidden, head) / self.logits_scaling


class GraniteMoeDecoderLayer(GraniteDecoderLayer, MoeDecoderLayer):
    """Granite's attention and ``forward`` around a sparse MoE block (built as
    :class:`MoeDecoderLayer`)."""


class GraniteMoeForCausalLM(GraniteForCausalLM, SparseMoeForCausalLM):
    """Granite 3.x MoE causal LM: Granite's multipliers (:class:`GraniteForCausalLM`) over the
    sparse-MoE decoder (:class:`~kvflow.models.mixtral.SparseMoeForCausalLM`, its
    construction and expert loading).

    Raises:
        ValueError: from the constructor when ``hidden_act`` is not SiLU.
    """

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = GraniteMoeDecoderLayer
    checkpoint_renames: ClassVar[dict[str, str]] = {
        ".block_sparse_moe.": ".mlp.",
        ".mlp.input_linear.weight": ".mlp.experts.gate_up_proj",
        ".mlp.output_linear.weight": ".mlp.experts.down_proj",
        ".mlp.router.layer.": ".mlp.gate.",
    }

    def make_mlp(self, config: Any, layer_idx: int, parallel: ParallelState) -> SparseMoeBlock:
        return SparseMoeBlock(config, config.num_local_experts, config.intermediate_size,
                              renormalize=True, shared_intermediate_size=0, parallel=parallel)
