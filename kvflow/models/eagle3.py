"""An EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", arXiv 2503.01840), in the checkpoint layout vLLM's
``Eagle3LlamaForCausalLM`` loads (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``).

EAGLE-3 reads not the target's final hidden state but a fusion of three of its layers: for a
position ``p`` the target's residual stream entering layers ``a``, ``b``, ``c`` (pre-norm;
vLLM's default ``(2, L // 2, L - 3)`` of an ``L``-layer target, or the head config's
``eagle_aux_hidden_state_layer_ids``), concatenated, is projected by ``fc`` [H, 3H] to
``g[p] = fc(concat(t_a[p], t_b[p], t_c[p]))`` (:meth:`Eagle3LlamaHead.combine`). The head's one
decoder layer then takes, for the token that follows, ``x[p+1]``:

    u = concat(input_layernorm(embed(x[p+1])), hidden_norm(g[p]))        [2H]
    r = g[p] + o_proj(attention(u))          (qkv_proj has 2H input columns)
    h'[p] = r + mlp(post_attention_layernorm(r))                         (pre-norm output)

(``norm_before_residual: true`` in the config: the residual starts from ``hidden_norm(g[p])``
instead.) The LM head reads ``norm(h'[p])``; the next draft step feeds ``h'[p]`` back in place
of ``g`` with no ``fc`` (it is already H wide), as vLLM's proposer does. Tensors (after an
optional ``model.`` prefix; ``midlayer.`` is read as ``layers.0.``, EAGLE's own naming):

* ``fc.weight`` [H, 3H]; ``layers.0.*`` (q/k/v/o, gate/up/down, ``input_layernorm``,
  ``hidden_norm``, ``post_attention_layernorm``); ``norm.weight``;
* ``lm_head.weight`` [draft_vocab_size, H]: the head's own, smaller vocabulary;
* ``d2t`` int64 [draft_vocab_size]: draft id ``i`` is target token ``i + d2t[i]`` (absent: 0,
  the first ``draft_vocab_size`` target ids); ``t2d`` (its inverse, a bool mask) is skipped;
* optional ``embed_tokens.weight``: the target's embedding is shared when absent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.layers.linear import QKVParallelLinear
from kvflow.layers.norm import RMSNorm
from kvflow.models.eagle import load_head_weights
from kvflow.models.llama import (
    AttentionBias,
    LlamaDecoderLayer,
    get_head_dim,
    make_rotary_embedding,
)


def eagle3_tensor_name(name: str) -> str:
    """A checkpoint name without the optional ``model.`` prefix, EAGLE's ``midlayer.`` read as
    ``layers.0.``."""
    name = name.removeprefix("model.")
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default taps of an ``num_layers``-layer target: ``(2, L // 2, L - 3)``, the
    residual stream entering those layers (Llama-3.1-8B, 32 layers: 2, 16, 29)."""
    return 2, num_layers // 2, num_layers - 3


class Eagle3LlamaHead(nn.Module):
    """The EAGLE-3 head: ``combine([T, n * H]) -> [T, H]`` (``fc`` over the target's taps),
    ``forward(input_ids [T], positions [T], features [T, H]) -> [T, H]`` (pre-norm ``h'``) and
    ``compute_logits([N, H]) -> float32 [N, draft_vocab_size]`` whose column ``i`` is target
    token ``draft_token_ids[i]``.

    Args:
        config: the head's HF config (one layer; ``hidden_size`` the target's;
            ``draft_vocab_size``, default ``vocab_size``).
        ctx: the head's attention context.
        tensor_names: the checkpoint's tensor names (an own ``embed_tokens`` or not).
        target: the target model (``embed_input_ids``), whose embedding serves a head
            without its own.
        num_taps: how many target layers ``fc`` fuses (3).
    """

    def __init__(self, config: Any, ctx: AttentionContext, tensor_names: Iterable[str],
                 target: nn.Module, num_taps: int = 3) -> None:
        super().__init__()
        names = {eagle3_tensor_name(n) for n in tensor_names}
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.fc = nn.Linear(num_taps * hidden, hidden, bias=False)
        bias = bool(getattr(config, "attention_bias", False))
        layer = LlamaDecoderLayer(config, 0, ctx, make_rotary_embedding(config),
                                  AttentionBias(qkv=bias, o=bias), False, ParallelState.single())
        heads = config.num_attention_heads
        layer.self_attn.qkv_proj = QKVParallelLinear(
            2 * hidden, get_head_dim(config), heads,
            getattr(config, "num_key_value_heads", None) or heads, bias)
        layer.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, eps)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden) \
            if "embed_tokens.weight" in names else None
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.logit_scale = float(getattr(config, "logit_scale", 1.0) or 1.0)
        self._target = [target]  # a list: not registered as this module's submodule

    def combine(self, taps: torch.Tensor) -> torch.Tensor:
        """[T, n * H] the target's taps side by side -> [T, H] ``g`` (``fc``)."""
        return self.fc(taps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                features: torch.Tensor) -> torch.Tensor:
        """int64 [T] tokens ``x[p+1]``, int64 [T] positions ``p``, [T, H] features (``g[p]``
        or the head's own ``h'`` fed back) -> [T, H] pre-norm ``h'[p]``."""
        layer = self.layers[0]
        embeds = self.embed_tokens(input_ids) if self.embed_tokens is not None else \
            self._target[0].embed_input_ids(input_ids)
        normed = layer.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        attn_in = torch.cat([layer.input_layernorm(embeds.to(features.dtype)), normed], dim=-1)
        hidden, residual = layer.post_attention_layernorm(
            layer.self_attn(positions, attn_in), residual)
        return layer.mlp(hidden) + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] pre-norm ``h'`` -> float32 [N, draft_vocab_size]: the head's LM head on
        ``norm(h')`` (times the config's ``logit_scale``, default 1)."""
        logits = self.lm_head.compute_logits(self.norm(hidden))
        return logits * self.logit_scale if self.logit_scale != 1.0 else logits

    def draft_token_ids(self) -> torch.Tensor:
        """int64 [draft_vocab_size]: the target token of each logits column (``i + d2t[i]``)."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the head's tensors (module docstring's names); returns the parameters loaded
        (``d2t`` is a buffer: not among them).

        Raises:
            ValueError: naming a tensor that matches no parameter or does not fit it (a
                ``d2t`` other than a vector of ``draft_vocab_size`` entries: its length and
                ``draft_vocab_size``).
        """
        return load_head_weights(self, self._parameter_weights(weights), "an EAGLE-3 head "
                                 "(fc, layers.0, norm, embed_tokens, lm_head, d2t)")

    def _parameter_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` under the head's names (:func:`eagle3_tensor_name`), less ``t2d``
        (skipped) and ``d2t`` (copied into its buffer on the way).

        Raises:
            ValueError: for a ``d2t`` other than a vector of ``draft_vocab_size`` entries.
        """
        for name, tensor in weights:
            name = eagle3_tensor_name(name)
            if name == "t2d":
                continue
            if name != "d2t":
                yield name, tensor
                continue
            if tuple(tensor.shape) != tuple(self.d2t.shape):  # would map ids onto wrong tokens
                got = f"has {len(tensor)} entries" if tensor.dim() == 1 else \
                    f"of shape {tuple(tensor.shape)} is not a vector"
                raise ValueError(f"checkpoint tensor 'd2t' {got}; the head's "
                                 f"draft_vocab_size is {self.draft_vocab_size} (its "
                                 "lm_head rows): d2t needs one entry per draft id (draft "
                                 "id i is target token i + d2t[i])")
            self.d2t.copy_(tensor.to(torch.int64))
