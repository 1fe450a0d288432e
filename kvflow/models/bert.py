"""BERT encoders for embeddings (``BertModel``: sentence-transformers' MiniLM, BGE, E5, ...).

Post-LayerNorm transformer encoder (Devlin et al. 2019): word + absolute position + token-type
embeddings and a LayerNorm, then per layer bidirectional self-attention and a GELU MLP, each
followed by residual add and LayerNorm. Attention is :class:`EncoderAttention` (no KV cache,
whole prompts per step; ``kvflow/attention/encoder.py`` says why). ``forward`` returns the last
layer's hidden states; the runner pools them (the HF ``pooler`` dense layer is not used by
sentence-transformers and is skipped when loading).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from kvflow.attention.encoder import EncoderAttention
from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.linear import QKVParallelLinear, ReplicatedLinear
from kvflow.models.fused_shards import note_loaded_shard


def _activation(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Positions counted from each sequence's start; ``token_type_ids`` int64 [T] (a
        cross-encoder's pair), None: one segment (token type 0)."""
        types = self.token_type_embeddings.weight[0] if token_type_ids is None \
            else self.token_type_embeddings(token_type_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + types
        return self.LayerNorm(x)


class BertSelfOutput(nn.Module):
    """dense -> + residual -> LayerNorm (after attention, and after the MLP)."""

    def __init__(self, in_size: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(in_size, hidden, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, ctx: AttentionContext) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads,
                                          bias=True)
        self.attn = EncoderAttention(heads, self.head_dim, self.head_dim ** -0.5, ctx)
        self.output = BertSelfOutput(config.hidden_size, config.hidden_size,
                                     config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = (x.view(t, -1, self.head_dim) for x in self.qkv_proj(hidden).chunk(3, -1))
        return self.output(self.attn(q, k, v).reshape(t, -1), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any, ctx: AttentionContext) -> None:
        super().__init__()
        self.attention = BertAttention(config, ctx)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config.intermediate_size, config.hidden_size,
                                     config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, ctx: AttentionContext) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, ctx)
                                   for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """``forward(input_ids [T], positions [T], token_type_ids [T] | None) -> hidden
    [T, hidden_size]`` for whole sequences (the step's ``query_start_loc`` delimits them).

    Args:
        config: an HF BertConfig (absolute positions only).
        ctx: the engine's attention context.
        parallel: must be one rank.

    Raises:
        ValueError: for tensor or pipeline parallelism, a position embedding type other
            than ``absolute``, or ``is_decoder`` (causal attention).
    """

    is_encoder_only: ClassVar[bool] = True
    is_pooling_only: ClassVar[bool] = True
    embeddings_cls: ClassVar[type[nn.Module]] = BertEmbeddings
    checkpoint_prefix: ClassVar[str] = "bert."  # BertForMaskedLM & co. (optional)
    skipped_prefixes: ClassVar[tuple[str, ...]] = ("pooler.", "cls.")
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "self.query": ("qkv_proj", "q"), "self.key": ("qkv_proj", "k"),
        "self.value": ("qkv_proj", "v")}

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        if parallel is not None and parallel.world.world_size > 1:
            raise ValueError("BERT encoders run on one rank (no tensor or pipeline "
                             "parallelism)")
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"BERT position_embedding_type={kind!r} is not supported")
        if getattr(config, "is_decoder", False):
            raise ValueError("BERT is_decoder=True (causal self-attention) is not supported: "
                             "kvflow runs BERT as a bidirectional encoder")
        self.config = config
        self.embeddings = self.embeddings_cls(config)
        self.encoder = BertEncoder(config, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF BERT tensors (``bert.`` prefix optional; the pooler, MLM head and
        position-id buffers are skipped); returns the parameter names loaded.

        Raises:
            ValueError: for a tensor that matches no parameter or whose shape does not fit it
                (naming the tensor).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix(self.checkpoint_prefix)
            if name.startswith(self.skipped_prefixes) or name.endswith(("position_ids",
                                                                      "token_type_ids")):
                continue
            name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
            target, shard = name, None
            for src, (dst, sid) in self.packed_modules_mapping.items():
                if f".{src}." in name:
                    target, shard = name.replace(f".{src}.", f".{dst}."), sid
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                 f"{type(self).__name__}")
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    if tensor.shape != param.shape:
                        raise ValueError(f"shape {tuple(tensor.shape)} does not fit the "
                                         f"{tuple(param.shape)} the config gives")
                    param.data.copy_(tensor)
                else:
                    loader(param, tensor, *(() if shard is None else (shard,)))
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            note_loaded_shard(param, shard)
            loaded.add(target)
        return loaded
