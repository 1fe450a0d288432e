"""Token embedding and LM head, split by vocabulary across TP ranks.

The table belongs to the layer's embedding method (``kvflow/quant/base.py``: unquantized by
default; a GGUF table stays in its quantized blocks): the layer keeps the vocabulary sharding,
``forward`` looks rows up through ``method.embedding`` and ``compute_logits`` multiplies through
``method.logits``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.comm import CommGroup
from kvflow.kernels.gemm import GemmPathMixin
from kvflow.layers.linear import require_group
from kvflow.quant.base import EmbeddingMethod
from kvflow.quant.unquantized import UnquantizedEmbeddingMethod


class VocabParallelEmbedding(nn.Module):
    """Embedding table [ceil(vocab_size / tp_size), hidden] per TP rank (rank r holds ids
    ``[r * shard, (r + 1) * shard)``); out-of-shard ids embed to zero and the ranks' rows are
    summed over ``tp_group`` (needed when ``tp_size > 1``)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0,
                 tp_size: int = 1, quant_method: EmbeddingMethod | None = None,
                 tp_group: CommGroup | None = None) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.tp_group = tp_group
        self.hidden_size = hidden_size
        self.shard_size = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.shard_size
        self.params_dtype = torch.get_default_dtype()
        self.quant_method: EmbeddingMethod | None = None
        self.set_quant_method(quant_method or UnquantizedEmbeddingMethod())

    def set_quant_method(self, method: EmbeddingMethod) -> None:
        """Replace the table with ``method``'s parameters (call before loading)."""
        for name in getattr(self, "_quant_param_names", ()):
            delattr(self, name)
        before = set(self._parameters)
        self.quant_method = method
        method.create_weights(self, self.shard_size, self.hidden_size, self.params_dtype)
        self._quant_param_names = tuple(n for n in self._parameters if n not in before)
        for name in self._quant_param_names:
            self._parameters[name].weight_loader = (  # type: ignore[attr-defined]
                lambda p, loaded: method.load(self, p, loaded))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows of the full table ``loaded`` into ``param``.

        Raises:
            ValueError: when ``loaded`` is not ``[vocab_size, hidden_size]`` (a config whose
                ``vocab_size`` or ``hidden_size`` does not describe the checkpoint).
        """
        if tuple(loaded.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"shape {tuple(loaded.shape)}: the config gives "
                             f"[vocab_size, hidden_size] = [{self.vocab_size}, "
                             f"{self.hidden_size}]")
        shard = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[:shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden]."""
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_ids)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        out = self.quant_method.embedding(self, local.clamp(0, self.shard_size - 1))
        out = out * mask.unsqueeze(-1)
        return require_group(self.tp_group, self.tp_size).all_reduce(out)


class ParallelLMHead(GemmPathMixin, VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab_size] (float32: with 16-bit weights the
        product's fp32 accumulation itself, never rounded to 16 bits)."""
        logits = self.quant_method.logits(self, hidden)
        if self.tp_size > 1:  # each rank's vocabulary shard, side by side
            logits = require_group(self.tp_group, self.tp_size).all_gather(logits, dim=-1)
        return logits[:, :self.vocab_size]
