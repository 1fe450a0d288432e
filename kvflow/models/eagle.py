"""An EAGLE-1 draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty", arXiv 2401.15077), in the checkpoint layout vLLM's
``EagleLlamaForCausalLM`` loads (e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``).

For a position ``p`` the head takes the token that FOLLOWS it, ``x[p+1]``, and the target's
final (post-norm) hidden state there, ``f[p]``, and computes

    h'[p] = layer0(fc(concat(embed(x[p+1]), f[p])))        (the residual stream's output)

``h'[p]`` stands in for ``f[p+1]``: the LM head turns it into a guess of ``x[p+2]``, and the
next draft step feeds it back in place of the target's feature. Tensors (names after an
optional ``model.`` prefix):

* ``fc.weight`` [H, 2H] (and ``fc.bias`` [H] where the checkpoint has one): the first H input
  columns take the embedding, the last H the feature (EAGLE's ``cat((embeds, hidden))``);
* ``layers.0.*``: one Llama decoder layer; EAGLE-1 drops its ``input_layernorm`` (applied
  only where the checkpoint has ``layers.0.input_layernorm.weight``);
* optional ``embed_tokens.weight`` / ``lm_head.weight``: the target's embedding and LM head
  are shared when absent; optional ``norm.weight``: applied before the LM head only (the
  hidden state fed back stays un-normed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.layers.norm import RMSNorm
from kvflow.models.llama import (
    AttentionBias,
    LlamaDecoderLayer,
    load_tensor,
    make_rotary_embedding,
    map_packed,
)

EAGLE_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                "up_proj": ("gate_up_proj", 1)}


def eagle_tensor_name(name: str) -> str:
    """A checkpoint name without the optional ``model.`` prefix (``lm_head.*`` keeps none)."""
    return name.removeprefix("model.")


class EagleLlamaHead(nn.Module):
    """The EAGLE-1 head: ``forward(input_ids [T], positions [T], features [T, H]) -> [T, H]``
    and ``compute_logits([N, H]) -> float32 [N, V]``.

    Args:
        config: the head's HF config (a LlamaConfig with one layer; ``hidden_size`` must be
            the target's).
        ctx: the head's attention context.
        tensor_names: the checkpoint's tensor names (module docstring): they decide the fc
            bias, the layer's input norm, the final norm and an own embedding / LM head.
        target: the target model (``embed_input_ids``, ``compute_logits``), used where the
            checkpoint has no embedding / LM head of its own.
    """

    def __init__(self, config: Any, ctx: AttentionContext, tensor_names: Iterable[str],
                 target: nn.Module) -> None:
        super().__init__()
        names = {eagle_tensor_name(n) for n in tensor_names}
        hidden = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias="fc.bias" in names)
        bias = bool(getattr(config, "attention_bias", False))
        layer = LlamaDecoderLayer(config, 0, ctx, make_rotary_embedding(config),
                                  AttentionBias(qkv=bias, o=bias), False, ParallelState.single())
        if "layers.0.input_layernorm.weight" not in names:
            layer.input_layernorm = nn.Identity()  # EAGLE-1: no norm before the attention
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, config.rms_norm_eps) if "norm.weight" in names else None
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden) \
            if "embed_tokens.weight" in names else None
        self.lm_head = ParallelLMHead(config.vocab_size, hidden) \
            if "lm_head.weight" in names else None
        self._target = [target]  # a list: not registered as this module's submodule

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                features: torch.Tensor) -> torch.Tensor:
        """int64 [T] tokens ``x[p+1]``, int64 [T] positions ``p``, [T, H] features ``f[p]``
        (the target's, or the head's own output fed back) -> [T, H] ``h'[p]``."""
        embeds = self.embed_tokens(input_ids) if self.embed_tokens is not None else \
            self._target[0].embed_input_ids(input_ids)
        hidden = self.fc(torch.cat([embeds.to(features.dtype), features], dim=-1))
        hidden, residual = self.layers[0](positions, hidden, None)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> float32 [N, V]: the head's LM head (or the target's) on ``h'``, after
        the head's final norm where it has one."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head.compute_logits(hidden)
        return self._target[0].compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the head's tensors (module docstring's names); returns the parameters loaded.

        Raises:
            ValueError: naming a tensor that matches no parameter or does not fit it.
        """
        return load_head_weights(self, ((eagle_tensor_name(n), t) for n, t in weights),
                                 "an EAGLE-1 head (fc, layers.0, norm, embed_tokens, lm_head)")


def load_head_weights(head: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                      what: str) -> set[str]:
    """Load an EAGLE head's checkpoint tensors (names already without their ``model.`` /
    ``midlayer.`` spelling; q/k/v and gate/up into the fused parameters,
    :data:`EAGLE_PACKED`; a saved ``rotary_emb.inv_freq`` skipped) into ``head``'s
    parameters; returns the parameters loaded (EAGLE-1's and EAGLE-3's ``load_weights``).

    Raises:
        ValueError: naming a tensor that matches no parameter of ``what`` (the head, with
            the parameter names it has), or one that does not fit (``load_tensor``).
    """
    params = dict(head.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        target, shard = map_packed(name, EAGLE_PACKED)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {what}")
        load_tensor(params[target], name, tensor, shard)
        loaded.add(target)
    return loaded
