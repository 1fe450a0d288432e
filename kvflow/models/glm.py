"""GLM-4 in transformers' layout: ``GlmForCausalLM`` (GLM-4-9B, the ``-hf`` checkpoints) and
``Glm4ForCausalLM`` (GLM-4-0414, GLM-Z1), as ``modeling_glm.py`` / ``modeling_glm4.py``
compute them. Both are the Llama decoder with:

* biases on q, k and v (``attention_bias``, true in released configs), none on o_proj;
* RoPE on the first ``head_dim * partial_rotary_factor`` dimensions of each head (0.5 by
  default), rotating adjacent pairs ``(x[2i], x[2i+1])`` (GPT-J style, not Llama's halves);
* gate and up stored as one ``gate_up_proj`` [2 I, hidden] (gate rows first).

GLM-4-0414 adds two norms inside the residual branches: ``post_self_attn_layernorm`` on the
attention output and ``post_mlp_layernorm`` on the MLP output, before each residual add
(``post_attention_layernorm`` stays the norm before the MLP, as in Llama).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import (
    AttentionBias,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    make_rotary_embedding,
)
from kvflow.models.phi3 import unfuse_projections


class GlmForCausalLM(LlamaForCausalLM):
    """GLM-4-9B causal LM (same interface as :class:`LlamaForCausalLM`)."""

    @classmethod
    def attention_bias_for(cls, config: Any) -> AttentionBias:
        return AttentionBias(qkv=bool(getattr(config, "attention_bias", True)), o=False)

    @classmethod
    def rotary_embedding_for(cls, config: Any) -> RotaryEmbedding:
        """Interleaved (adjacent-pair) RoPE over ``partial_rotary_factor`` of each head."""
        return make_rotary_embedding(config, is_neox_style=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, the fused ``gate_up_proj`` split into gate and up."""
        return super().load_weights(unfuse_projections(weights, self.config))


class Glm4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer plus ``post_self_attn_layernorm`` and ``post_mlp_layernorm`` on the
    attention and MLP outputs (same fused-residual ``forward`` contract)."""

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def attention_output(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.post_self_attn_layernorm(self.self_attn(positions, hidden))

    def mlp_output(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_layernorm(self.mlp(hidden))


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414 causal LM: :class:`GlmForCausalLM` with :class:`Glm4DecoderLayer`."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = Glm4DecoderLayer
