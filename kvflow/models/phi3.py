"""Phi-3 (``Phi3ForCausalLM``): a Llama-shaped decoder whose checkpoints store q/k/v as one
fused ``qkv_proj`` and gate/up as one fused ``gate_up_proj``, with LongRoPE (``longrope``, the
older name ``su``) scaling on the long-context variants (Phi-3 technical report, Abdin et al.
2024, section 2; LongRoPE, Ding et al. 2024) and an optional partial rotary dimension.

The fused checkpoint tensors are split back into their q/k/v and gate/up parts on the way in,
so each part goes through the same tensor-parallel ``weight_loader`` as a Llama checkpoint's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kvflow.models.llama import AttentionBias, LlamaForCausalLM, get_head_dim


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM (same interface as :class:`LlamaForCausalLM`; the RoPE table, LongRoPE
    and partial rotary included, comes from :func:`kvflow.models.llama.make_rotary_embedding`)."""

    @classmethod
    def attention_bias_for(cls, config: Any) -> AttentionBias:
        return AttentionBias(qkv=False, o=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named Phi-3 tensors (fused ``qkv_proj`` / ``gate_up_proj`` included)."""
        return super().load_weights(unfuse_projections(weights, self.config))


def unfuse_projections(weights: Iterable[tuple[str, torch.Tensor]], config: Any
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Split a checkpoint's fused ``qkv_proj`` [(Hq + 2 Hkv) * D, hidden] into q/k/v and
    ``gate_up_proj`` [2 I, hidden] into gate/up (the checkpoint's row order: q, k, v; gate,
    up), so each part loads through Llama's tensor-parallel ``weight_loader`` (Phi-3; GLM's
    fused gate/up)."""
    head_dim = get_head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    sizes = [config.num_attention_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    for name, tensor in weights:
        if ".qkv_proj." in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes)):
                yield name.replace(".qkv_proj.", f".{part}."), _tagged(chunk, tensor)
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), _tagged(gate, tensor)
            yield name.replace(".gate_up_proj.", ".up_proj."), _tagged(up, tensor)
        else:
            yield name, tensor


def _tagged(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``part`` with ``whole``'s ``ggml_type`` tag, if any (a kept-quantized GGUF tensor's
    rows of raw blocks split by rows stay blocks of that type)."""
    if hasattr(whole, "ggml_type"):
        part.ggml_type = whole.ggml_type  # type: ignore[attr-defined]
    return part
