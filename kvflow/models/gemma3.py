"""Gemma 3 text models (``Gemma3ForCausalLM``; GGUF architecture ``gemma3``).

Differences from Llama, after the Gemma 3 technical report (Gemma Team, 2025, sections 2.1-2.2)
and transformers' ``modeling_gemma3.py``:

* GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``;
* four RMSNorms per layer, all of the ``(1 + weight)`` kind: before and after attention, before
  and after the MLP (the "post" norms sit inside the residual branch);
* embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the compute dtype);
* per-head RMSNorm on q and k (replacing Gemma 2's attention soft-capping);
* local/global interleaving: ``layer_types`` marks each layer ``sliding_attention`` (window of
  ``sliding_window`` tokens, RoPE base ``rope_local_base_freq``, 10k) or ``full_attention``
  (RoPE base 1M, possibly scaled); 5 local : 1 global in released checkpoints;
* attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
* optional final logit soft-capping ``cap * tanh(logits / cap)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import Any, ClassVar

import torch
from torch import nn

from kvflow.attention.layer import Attention, AttentionContext
from kvflow.distributed.comm import IntermediateTensors
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.activation import GeluAndMul
from kvflow.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvflow.layers.norm import GemmaRMSNorm
from kvflow.layers.rope_parameters import get_rope_parameters, rope_max_positions
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import (
    LlamaForCausalLM,
    get_head_dim,
    layer_sliding_window,
    make_lm_head,
)
from kvflow.models.parallel_utils import PPMissingLayer, make_layers


def gemma3_rope_tables(config: Any) -> dict[str, RotaryEmbedding]:
    """One RoPE table per layer type: ``{"full_attention": ..., "sliding_attention": ...}``.

    transformers 5 keeps ``rope_parameters = {layer_type: {rope_theta, rope_type, ...}}``;
    older configs have ``rope_theta`` (global), ``rope_local_base_freq`` (local) and an
    optional ``rope_scaling`` that applies to global layers only.
    """
    head_dim, max_pos = get_head_dim(config), rope_max_positions(config)
    params = getattr(config, "rope_parameters", None) or {}
    tables = {}
    for layer_type, default_theta in (("full_attention", None),
                                      ("sliding_attention", "rope_local_base_freq")):
        entry = params.get(layer_type) if isinstance(params, dict) else None
        if entry is not None:
            theta, scaling = get_rope_parameters(_RopeView(entry, config))
        elif layer_type == "full_attention":
            theta, scaling = get_rope_parameters(config)
        else:
            theta, scaling = float(getattr(config, default_theta, 10000.0)), None
        tables[layer_type] = RotaryEmbedding(head_dim, max_pos, theta, scaling)
    return tables


class _RopeView:
    """Presents one per-layer-type RoPE dict as a config to ``get_rope_parameters``, with the
    config's own (unscaled) ``max_position_embeddings``, which YaRN's implied factor and
    dynamic NTK's original length are read from, as transformers reads them; never the
    table's length (``rope_max_positions``, already scaled by dynamic NTK's factor)."""

    def __init__(self, entry: dict, config: Any) -> None:
        self.rope_parameters = entry
        self.max_position_embeddings = config.max_position_embeddings
        self.original_max_position_embeddings = \
            getattr(config, "original_max_position_embeddings", None)


def check_gemma3_attention(config: Any) -> None:
    """Refuse the attention variants of Gemma 3 configs that kvflow does not compute.

    Raises:
        ValueError: naming the field, for ``attn_logit_softcapping`` (Gemma 2's soft-capped
            attention logits) or ``use_bidirectional_attention`` (EmbeddingGemma: every token
            attends to the whole prompt; kvflow runs Gemma 3 as a causal decoder).
    """
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        raise ValueError(f"Gemma 3 attn_logit_softcapping={cap!r}: attention logit "
                         "soft-capping is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 use_bidirectional_attention=True is not supported: kvflow "
                         "runs Gemma 3 as a causal decoder (bidirectional attention would be "
                         "computed causally, giving wrong outputs)")


class Gemma3Attention(nn.Module):
    """Gemma 3's attention (per-head q/k norm); Gemma 2's subclass drops the norms and
    soft-caps the scores (``qk_norm``, :meth:`logits_soft_cap`)."""

    qk_norm: ClassVar[bool] = True

    @staticmethod
    def logits_soft_cap(config: Any) -> float | None:
        """The attention-logit cap (None: none); Gemma 3 refuses a configured one."""
        check_gemma3_attention(config)
        return None

    def __init__(self, config: Any, layer_idx: int, ctx: AttentionContext,
                 rotary_emb: RotaryEmbedding, parallel: ParallelState) -> None:
        super().__init__()
        soft_cap = self.logits_soft_cap(config)
        tp = parallel.tp
        self.head_dim = get_head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads, bias, tp.rank,
                                          tp.world_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias, tp.rank, tp.world_size,
                                        tp_group=tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if self.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if self.qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              config.query_pre_attn_scalar ** -0.5, ctx,
                              sliding_window=layer_sliding_window(config, layer_idx),
                              logits_soft_cap=soft_cap)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions [T] int64, hidden [T, hidden_size] -> [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn.forward_rotary(positions, q, k, v, self.rotary_emb)
        return self.o_proj(out.reshape(num_tokens, q_size))


class Gemma3MLP(nn.Module):
    """GeGLU MLP: [T, hidden] -> [T, hidden]."""

    def __init__(self, config: Any, parallel: ParallelState) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}")
        tp = parallel.tp
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], False,
                                                       tp.rank, tp.world_size)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp.rank,
                                           tp.world_size, tp_group=tp)
        self.act_fn = GeluAndMul("none" if act == "gelu" else "tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """``h = x + post_attn_norm(attn(input_norm(x)))``;
    ``out = h + post_ffw_norm(mlp(pre_ffw_norm(h)))``."""

    attention_cls: ClassVar[type[Gemma3Attention]] = Gemma3Attention

    def __init__(self, config: Any, layer_idx: int, ctx: AttentionContext,
                 rotary_emb: RotaryEmbedding, parallel: ParallelState) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self.attention_cls(config, layer_idx, ctx, rotary_emb, parallel)
        self.mlp = Gemma3MLP(config, parallel)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    """One pipeline stage's share: scaled embedding (first stage), layers
    ``[start_layer, end_layer)`` of ``layer_cls``, final norm (last stage); ``tables`` the
    RoPE table per layer type (:func:`gemma3_rope_tables`)."""

    def __init__(self, config: Any, ctx: AttentionContext, parallel: ParallelState,
                 layer_cls: type[Gemma3DecoderLayer] = Gemma3DecoderLayer,
                 tables: dict[str, RotaryEmbedding] | None = None) -> None:
        super().__init__()
        tp, pp = parallel.tp, parallel.pp
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp.rank, tp.world_size,
            tp_group=tp) \
            if self.is_first_stage else PPMissingLayer()
        self.embed_scale = config.hidden_size ** 0.5
        tables = tables or gemma3_rope_tables(config)
        self.rotary_local, self.rotary_global = tables["sliding_attention"], \
            tables["full_attention"]
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, pp, lambda i: layer_cls(
                config, i, ctx, self.rotary_local if layer_sliding_window(config, i)
                else self.rotary_global, parallel))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) \
            if self.is_last_stage else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """[T] ids and positions -> final hidden [T, hidden] on the last stage, else
        ``{"hidden_states": [T, hidden]}`` for the next stage."""
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids)
            # transformers rounds the scale to the weights' dtype before multiplying.
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        else:
            hidden = intermediate_tensors["hidden_states"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden = layer(positions, hidden)
        return self.norm(hidden) if self.is_last_stage else {"hidden_states": hidden}


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 causal LM: ``forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]``
    and ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]`` float32 (soft-capped
    when ``final_logit_softcapping`` is set; ``head``: another LM head's rows instead of
    ``lm_head``'s, capped the same).

    Args:
        config: a ``Gemma3TextConfig``.
        ctx: the engine's attention context.
        parallel: this rank's process groups (default: one process); see
            :class:`~kvflow.models.llama.LlamaForCausalLM` for pipeline stages.
    """

    # LoRA adapts the same fused layers as in Llama (kvflow/lora)
    supported_lora_modules: ClassVar[tuple[str, ...]] = LlamaForCausalLM.supported_lora_modules
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = \
        LlamaForCausalLM.packed_modules_mapping
    decoder_layer_cls: ClassVar[type[Gemma3DecoderLayer]] = Gemma3DecoderLayer

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.config = config
        parallel = parallel or ParallelState.single()
        self.model = Gemma3Model(config, ctx, parallel, self.decoder_layer_cls,
                                 self.rope_tables(config))
        self.lm_head = make_lm_head(config, parallel, self.model.embed_tokens,
                                    getattr(config, "tie_word_embeddings", True))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def rope_tables(cls, config: Any) -> dict[str, RotaryEmbedding]:
        """The RoPE table of each layer type (:func:`gemma3_rope_tables`)."""
        return gemma3_rope_tables(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden: torch.Tensor,
                       head: ParallelLMHead | None = None) -> torch.Tensor:
        logits = (head or self.lm_head).compute_logits(hidden)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (q/k/v and gate/up fused on the way in); returns the names of
        the parameters loaded. Raises ValueError for a tensor that matches no parameter."""
        return LlamaForCausalLM.load_weights(self, _strip_language_model(weights))


def _strip_language_model(weights: Iterable[tuple[str, torch.Tensor]]):
    """Accept the text tower of a multimodal Gemma 3 checkpoint too
    (``model.language_model.*`` -> ``model.*``)."""
    for name, tensor in weights:
        yield name.replace("model.language_model.", "model.", 1), tensor
