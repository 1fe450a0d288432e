"""Gemma 2 (``Gemma2ForCausalLM``; Gemma 2 technical report, Gemma Team 2024, section 2), on
Gemma 3's modules (``kvflow/models/gemma3.py``: GeGLU MLP, four ``(1 + weight)`` RMSNorms per
layer, embeddings times ``sqrt(hidden_size)``, ``query_pre_attn_scalar``, local/global
layers from ``layer_types``, final logit soft-capping). Gemma 2 differs from Gemma 3 in:

* no q/k norm; instead the attention scores are soft-capped,
  ``attn_logit_softcapping * tanh(q.k * scale / attn_logit_softcapping)``, before the mask
  and softmax. The cpu, triton and torch attention backends compute that (their kernels'
  ``softcap``); the engine refuses a named backend without it and context parallelism,
  naming the field;
* one RoPE table (``rope_theta``) for local and global layers alike.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM
from kvflow.models.llama import make_rotary_embedding


class Gemma2Attention(Gemma3Attention):
    """Gemma 3's attention without q/k norm, with soft-capped scores."""

    qk_norm: ClassVar[bool] = False

    @staticmethod
    def logits_soft_cap(config: Any) -> float | None:
        """``attn_logit_softcapping`` (None: no cap).

        Raises:
            ValueError: for ``use_bidirectional_attention`` (kvflow runs Gemma 2 causally).
        """
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 2 use_bidirectional_attention=True is not supported: "
                             "kvflow runs Gemma 2 as a causal decoder")
        return Gemma2ForCausalLM.attention_soft_cap(config)


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention_cls: ClassVar[type[Gemma3Attention]] = Gemma2Attention


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 causal LM (same interface as :class:`Gemma3ForCausalLM`).

    Raises:
        ValueError: from the constructor for ``use_bidirectional_attention``, or for
            ``attn_logit_softcapping`` on an attention backend without soft-capping
            (``supports_logits_soft_cap``).
    """

    decoder_layer_cls: ClassVar[type[Gemma3DecoderLayer]] = Gemma2DecoderLayer

    @classmethod
    def attention_soft_cap(cls, config: Any) -> float | None:
        """The config's ``attn_logit_softcapping`` (None when unset or null)."""
        cap = getattr(config, "attn_logit_softcapping", None)
        return None if cap is None else float(cap)

    @classmethod
    def rope_tables(cls, config: Any) -> dict[str, RotaryEmbedding]:
        """One table (``rope_theta``, the config's scaling) for both layer types."""
        table = make_rotary_embedding(config)
        return {"full_attention": table, "sliding_attention": table}
